"""The trainer's side of training-inference consistency: a transformers float32 forward of a checkpoint over whole
token sequences, each token's log-prob given the tokens before it.

Run with the venv `setup.sh` made (it has torch): reads `{"model": DIR, "sequences": [[id, ...], ...]}` as JSON on
stdin, writes `[[logprob of token 1, ..., logprob of token n-1], ...]` as JSON on stdout (token 0 has none).
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM


@torch.no_grad()
def logprobs(model: AutoModelForCausalLM, tokens: list[int]) -> list[float]:
    """log p(tokens[i] | tokens[:i]) for i = 1 .. len(tokens) - 1, from one teacher-forced forward."""
    ids = torch.tensor([tokens])
    logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.gather(1, ids[0, 1:, None])[:, 0].tolist()


def main() -> None:
    request = json.load(sys.stdin)
    model = AutoModelForCausalLM.from_pretrained(request["model"], dtype=torch.float32).eval()
    json.dump([logprobs(model, tokens) for tokens in request["sequences"]], sys.stdout)


if __name__ == "__main__":
    main()
