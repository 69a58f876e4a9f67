"""The trainer's side of training-inference consistency: a transformers float32 forward of a checkpoint over whole
token sequences, each token's log-prob given the tokens before it.

Run with the venv `setup.sh` made (it has torch): reads `{"model": DIR, "sequences": [[id, ...], ...]}` as JSON on
stdin, writes `[[logprob of token 1, ..., logprob of token n-1], ...]` as JSON on stdout (token 0 has none).
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM


def load(model_dir: str) -> AutoModelForCausalLM:
    """The checkpoint in float32, for inference."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def distributions(model: AutoModelForCausalLM, tokens: list[int]) -> torch.Tensor:
    """Log-softmax of the next token after each of tokens[:-1], from one teacher-forced forward."""
    return torch.log_softmax(model(torch.tensor([tokens])).logits[0, :-1].float(), dim=-1)


def logprobs(model: AutoModelForCausalLM, tokens: list[int]) -> list[float]:
    """log p(tokens[i] | tokens[:i]) for i = 1 .. len(tokens) - 1."""
    return distributions(model, tokens).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def main() -> None:
    request = json.load(sys.stdin)
    model = load(request["model"])
    json.dump([logprobs(model, tokens) for tokens in request["sequences"]], sys.stdout)


if __name__ == "__main__":
    main()
