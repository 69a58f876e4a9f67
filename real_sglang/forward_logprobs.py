"""The trainer's side of training-inference consistency: a transformers float32 forward of a checkpoint over whole
token sequences, each token's log-prob given the tokens before it.

Run with the venv `setup.sh` made (it has torch): reads `{"model": DIR, "sequences": [[id, ...], ...], "temperature":
T}` as JSON on stdin, writes `[[logprob of token 1, ..., logprob of token n-1], ...]` as JSON on stdout (token 0 has
none). The logits are divided by the sampling temperature (default 1) before the softmax, as slime's trainer does
with `--rollout-temperature`: the engine's log-probs are those of the distribution it sampled from.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM


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


def main() -> None:
    request = json.load(sys.stdin)
    model = load(request["model"])
    temperature = float(request.get("temperature", 1.0))
    json.dump([logprobs(model, tokens, temperature) for tokens in request["sequences"]], sys.stdout)


if __name__ == "__main__":
    main()
