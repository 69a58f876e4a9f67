"""Vision: one assistant turn about the row's images, reward 1 when the answer names the label.

Input rows: `prompt` (the question), `images` (each a data URL or base64 of a PNG, JPEG, WebP, GIF or BMP) and
`label` (a word the right answer holds, e.g. a colour). The run's `tokenizer_path` must be a vision checkpoint's
(a `preprocessor_config.json` of a Qwen2-VL-style image processor beside its tokenizer): each image takes the
tokens its processor gives it, and the engine gets the images with the ids (docs/multimodal.md).
"""

from __future__ import annotations

from typing import Any

from rollout_buffer.generator_api import RolloutContext, Trajectory

TASK_TYPE = "vision"
REQUIRED_FIELDS = ("prompt", "images", "label")


async def run_rollout(item: dict[str, Any], ctx: RolloutContext) -> Trajectory:
    """Ask about the row's images and score the answer against `label`."""
    parts = [*({"type": "image", "image": image} for image in item["images"]), {"type": "text", "text": item["prompt"]}]
    conv = await ctx.conversation([{"role": "user", "content": parts}])
    finish = await ctx.generate(conv)
    answer = conv.messages[-1]["content"] if conv.messages[-1]["role"] == "assistant" else ""
    reward = 1.0 if str(item["label"]).lower() in answer.lower() else 0.0
    return await ctx.trajectory(conv, reward, finish, label=item["label"])
