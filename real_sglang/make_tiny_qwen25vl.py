"""Build a tiny random-weight Qwen2.5-VL checkpoint (float32) with the real Qwen3 tokenizer, the buffer's
multimodal chat template and Qwen2.5-VL's image processor config (`rollout_sim/vision/`: the files of the
simulator's vision checkpoint), for SGLang's own multimodal path on CPU.

Usage: python make_tiny_qwen25vl.py OUT_DIR SEED TOKENIZER_DIR VISION_FILES_DIR
"""
import json
import os
import shutil
import sys

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration


def main():
    out, seed, tok_dir, vision_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.manual_seed(seed)
    text = dict(vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}, initializer_range=0.5,
                tie_word_embeddings=False)
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1],
                  in_chans=3)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
                           vision_start_token_id=151652, vision_end_token_id=151653, bos_token_id=151643,
                           eos_token_id=151645, torch_dtype="float32", **text)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32).eval()
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(tmp, f))
    tok_config = json.load(open(os.path.join(tok_dir, "tokenizer_config.json")))
    tok_config["chat_template"] = open(os.path.join(vision_dir, "chat_template.jinja")).read()
    json.dump(tok_config, open(os.path.join(tmp, "tokenizer_config.json"), "w"))
    shutil.copy(os.path.join(vision_dir, "preprocessor_config.json"), os.path.join(tmp, "preprocessor_config.json"))
    cpath = os.path.join(tmp, "config.json")
    c = json.load(open(cpath))
    c["torch_dtype"] = "float32"
    c["dtype"] = "float32"
    json.dump(c, open(cpath, "w"), indent=2)
    json.dump({"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643},
              open(os.path.join(tmp, "generation_config.json"), "w"), indent=2)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    print(f"[make_tiny_qwen25vl] {out}: seed={seed} params={sum(p.numel() for p in model.parameters())}")


if __name__ == "__main__":
    main()
