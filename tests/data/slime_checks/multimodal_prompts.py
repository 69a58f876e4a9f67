"""slime's own multimodal prompt path over the prompts of the buffer's records, run in the real-SGLang venv (whose
patched torchvision lets transformers' AutoProcessor load a Qwen-VL processor) with the pinned slime on the path:
the dataset's steps (`process_vision_info`, the tokenizer's chat template), then `_prepare_prompt_ids` from
`slime/rollout/sglang_rollout.py` itself (that module's imports need Ray, so the function's own source is compiled
alone) and `encode_image_for_rollout_engine` for what slime would send the engine.

    python multimodal_prompts.py CHECKPOINT CASES.json OUT_DIR

Each case is `{"messages": [...]}` (slime's conversation form, images as data URLs). Writes OUT_DIR/result.json
(per case: the prompt ids, `image_grid_thw`, and whether the engine's images have the prompt's pixels) and
OUT_DIR/pixel_values-K.npy.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from slime.utils import processing_utils
from slime.utils.types import Sample


def slime_function(name: str) -> Any:
    """`name` from slime's rollout module, compiled from its source with what it uses."""
    import slime

    source = Path(slime.__file__).parent / "rollout" / "sglang_rollout.py"
    tree = ast.parse(source.read_text())
    keep = [n for n in tree.body
            if (isinstance(n, ast.FunctionDef) and n.name == name)
            or (isinstance(n, ast.Assign) and [getattr(t, "id", "") for t in n.targets] == ["_PROCESSOR_PROMPT_KEYS"])]
    assert len(keep) == 2, f"slime's {source} no longer defines {name} and _PROCESSOR_PROMPT_KEYS"
    scope: dict[str, Any] = {"Any": Any, "Sample": Sample,
                             "build_processor_kwargs": processing_utils.build_processor_kwargs}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(source), "exec"), scope)
    return scope[name]


def pixels(data_url: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data_url.split(",", 1)[1]))).convert("RGB"))


def main() -> None:
    checkpoint, cases, out = sys.argv[1], json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    processor = processing_utils.load_processor(checkpoint)
    tokenizer = processing_utils.load_tokenizer(checkpoint)
    prepare_prompt_ids = slime_function("_prepare_prompt_ids")
    results = []
    for k, case in enumerate(cases):
        messages = case["messages"]
        sample = Sample(prompt=tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                        multimodal_inputs=processing_utils.process_vision_info(messages, processor))
        ids = prepare_prompt_ids(sample, tokenizer, processor)
        train = sample.multimodal_train_inputs
        np.save(out / f"pixel_values-{k}.npy", train["pixel_values"].numpy())
        sent = [processing_utils.encode_image_for_rollout_engine(i) for i in sample.multimodal_inputs["images"]]
        given = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
                 if p.get("type") == "image"]
        results.append({"processor": type(processor).__name__, "prompt_ids": [int(t) for t in ids],
                        "image_grid_thw": train["image_grid_thw"].tolist(),
                        "engine_pixels_equal": [bool(np.array_equal(pixels(a), pixels(b)))
                                                for a, b in zip(sent, given, strict=True)]})
    (out / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
