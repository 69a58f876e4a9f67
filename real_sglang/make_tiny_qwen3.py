"""Build a tiny random-weight Qwen3ForCausalLM checkpoint (float32) with the real Qwen3 tokenizer.

Usage: python make_tiny_qwen3.py OUT_DIR SEED TOKENIZER_DIR

Weights are random but drawn with a large initializer_range so the next-token
distribution is peaked (log-probs far from uniform -log(151936) = -11.93).
Deterministic for a given seed on a given torch version.
"""
import json
import os
import shutil
import sys

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM


def main():
    out, seed, tok_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        pad_token_id=151643,
        torch_dtype="float32",
    )
    model = Qwen3ForCausalLM(cfg).to(torch.float32).eval()
    # Extra peaking: scale lm_head so greedy top-1 is clearly separated.
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(tmp, f))
    # Make sure config.json says float32 under both spellings across transformers versions.
    cpath = os.path.join(tmp, "config.json")
    c = json.load(open(cpath))
    c["torch_dtype"] = "float32"
    c["dtype"] = "float32"
    json.dump(c, open(cpath, "w"), indent=2)
    json.dump(
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643},
        open(os.path.join(tmp, "generation_config.json"), "w"),
        indent=2,
    )
    # sanity: the tokenizer loads and the model gives peaked log-probs
    tok = AutoTokenizer.from_pretrained(tmp)
    ids = tok("Hello, world! The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    print(f"[make_tiny_qwen3] {out}: seed={seed} params={sum(p.numel() for p in model.parameters())} "
          f"top1 logprob={lp.max().item():.4f} (uniform={-torch.log(torch.tensor(151936.0)).item():.2f})")


if __name__ == "__main__":
    main()
