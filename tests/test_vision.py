"""How many tokens an image takes in a Qwen-VL prompt (`media.vision`), held equal to transformers' own image
processor for those checkpoints, and the placeholder of each image expanded in place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollout_buffer.media.vision import VisionProcessor
from rollout_buffer.tokens.tokenizer import load_tokenizer
from rollout_sim.vision_checkpoint import FILES

SIZES = [(64, 48), (1280, 800), (800, 1280), (28, 28), (13, 900), (3000, 2000), (1920, 1080), (500, 333), (7, 7)]


@pytest.fixture(scope="module")
def vision(qwen_tokenizer_path: str, tmp_path_factory: pytest.TempPathFactory) -> VisionProcessor:
    folder = tmp_path_factory.mktemp("ck")
    (folder / "preprocessor_config.json").write_text((FILES / "preprocessor_config.json").read_text())
    found = VisionProcessor.of(folder, load_tokenizer(qwen_tokenizer_path))
    assert found is not None
    return found


@pytest.mark.parametrize(("patch", "config"), [
    (14, {"min_pixels": 3136, "max_pixels": 12845056}),  # Qwen2.5-VL's
    (14, {"min_pixels": 3136, "max_pixels": 200704}),  # the tests' checkpoint
    (16, {"size": {"shortest_edge": 65536, "longest_edge": 16777216}}),  # Qwen3-VL's
])
def test_the_count_is_transformers_own(patch: int, config: dict[str, Any], tmp_path: Path,
                                       qwen_tokenizer_path: str) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch, "merge_size": 2, **config}))
    ours = VisionProcessor.of(tmp_path, load_tokenizer(qwen_tokenizer_path))
    assert ours is not None
    size = config.get("size") or {"shortest_edge": config["min_pixels"], "longest_edge": config["max_pixels"]}
    theirs = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, size=size)
    for width, height in SIZES:
        if max(width, height) / min(width, height) > 200:
            continue
        assert ours.tokens(width, height) == theirs.get_number_of_image_patches(height, width, {}) // 4, (width, height)


def test_each_placeholder_is_expanded_in_place(vision: VisionProcessor) -> None:
    start, pad, end = vision.start_id, vision.pad_id, vision.end_id
    ids = [1, start, pad, end, 2, start, pad, end, 3]
    out = vision.expanded(ids, [(64, 48), (1280, 800)])
    assert out == [1, start, *[pad] * vision.tokens(64, 48), end, 2, start, *[pad] * vision.tokens(1280, 800), end, 3]
    assert vision.tokens(1280, 800) <= 256  # the tests' checkpoint: at most 256 tokens an image
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        vision.expanded(ids, [(64, 48)])


def test_a_checkpoint_without_an_image_processor_reads_no_images(tmp_path: Path, qwen_tokenizer_path: str) -> None:
    assert VisionProcessor.of(tmp_path, load_tokenizer(qwen_tokenizer_path)) is None
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "SiglipImageProcessor"}))
    with pytest.raises(ValueError, match="Qwen2-VL-style"):
        VisionProcessor.of(tmp_path, load_tokenizer(qwen_tokenizer_path))
