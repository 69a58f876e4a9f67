"""The trainer's side of training-inference consistency: a transformers float32 forward of a checkpoint over whole
token sequences, each token's log-prob given the tokens before it.

Run with the venv `setup.sh` made (it has torch): reads `{"model": DIR, "sequences": [[id, ...], ...], "temperature":
T}` as JSON on stdin, writes `[[logprob of token 1, ..., logprob of token n-1], ...]` as JSON on stdout (token 0 has
none). With `"images": [[base64 image, ...], ...]` (one list a sequence, in the order of its image placeholders) the
checkpoint is a vision-language one: its image processor's `pixel_values` and `image_grid_thw` go into the forward
with the tokens, whose image pads are already expanded, as slime's trainer feeds them. The logits are divided by
the sampling temperature (default 1) before the softmax, as slime's trainer does
with `--rollout-temperature`: the engine's log-probs are those of the distribution it sampled from.
"""

import base64
import io
import json
import sys

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText


def load(model_dir: str) -> AutoModelForCausalLM:
    """The checkpoint in float32, for inference."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def distributions(model: AutoModelForCausalLM, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-softmax of the next token after each of tokens[:-1] at `temperature`, from one teacher-forced forward."""
    return torch.log_softmax(model(torch.tensor([tokens])).logits[0, :-1].float() / temperature, dim=-1)


def logprobs(model: AutoModelForCausalLM, tokens: list[int], temperature: float = 1.0) -> list[float]:
    """log p(tokens[i] | tokens[:i]) for i = 1 .. len(tokens) - 1."""
    dist = distributions(model, tokens, temperature)
    return dist.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


@torch.no_grad()
def vision_logprobs(model, processor, tokens: list[int], images: list[str], temperature: float = 1.0) -> list[float]:
    """As `logprobs`, with the images the tokens' placeholders stand for."""
    pictures = [Image.open(io.BytesIO(base64.b64decode(i))).convert("RGB") for i in images]
    ids = torch.tensor([tokens])
    inputs = dict(processor(images=pictures, return_tensors="pt")) if pictures else {}
    if pictures:  # which tokens are the images': without it transformers gives them text positions, not M-RoPE's
        inputs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    logits = model(input_ids=ids, **inputs).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def main() -> None:
    request = json.load(sys.stdin)
    temperature = float(request.get("temperature", 1.0))
    if "images" in request:
        model = AutoModelForImageTextToText.from_pretrained(request["model"], dtype=torch.float32).eval()
        processor = AutoImageProcessor.from_pretrained(request["model"])
        json.dump([vision_logprobs(model, processor, tokens, images, temperature)
                   for tokens, images in zip(request["sequences"], request["images"], strict=True)], sys.stdout)
        return
    model = load(request["model"])
    json.dump([logprobs(model, tokens, temperature) for tokens in request["sequences"]], sys.stdout)


if __name__ == "__main__":
    main()
