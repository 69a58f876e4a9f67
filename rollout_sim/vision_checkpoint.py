"""A Qwen-VL-style checkpoint for the simulated engine, the tests and the benchmarks, made offline from files in the
repository: the bundled Qwen3 tokenizer (whose vocabulary holds the vision tokens) with a multimodal chat template
(`vision/chat_template.jinja`: Qwen3's, each image part of a message written as `<|vision_start|><|image_pad|>
<|vision_end|>`, as Qwen2.5-VL's and Qwen3-VL's templates write it) and a Qwen2.5-VL image processor config
(`vision/preprocessor_config.json`: patch 14, merge 2, at most 256 tokens an image)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

from PIL import Image

from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path

FILES = Path(__file__).parent / "vision"


def vision_checkpoint(folder: Path) -> Path:
    """The checkpoint's folder, made in `folder` (again each time: it is small)."""
    folder.mkdir(parents=True, exist_ok=True)
    bundled = Path(bundled_tokenizer_path())
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copy(bundled / name, folder / name)
    config = json.loads((bundled / "tokenizer_config.json").read_text())
    config["chat_template"] = (FILES / "chat_template.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(FILES / "preprocessor_config.json", folder / "preprocessor_config.json")
    return folder


def png(colour: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    """A PNG of one colour."""
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()
