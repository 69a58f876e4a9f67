"""Reference log-probs from a transformers float32 forward (used by smoke.py)."""
import torch
from transformers import AutoModelForCausalLM

_cache = {}

def load(path):
    if path not in _cache:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        _cache[path] = m
    return _cache[path]

@torch.no_grad()
def output_logprobs(path, prompt_ids, output_ids):
    """log p(output_ids[i] | prompt + output[:i]) from one teacher-forced forward.
    Uses logits at positions len(prompt)-1 ... len(tokens)-2. Also returns the greedy argmax ids."""
    model = load(path)
    toks = torch.tensor([list(prompt_ids) + list(output_ids)])
    logits = model(toks).logits[0].float()
    n = len(prompt_ids)
    lp = torch.log_softmax(logits[n - 1 : toks.shape[1] - 1], dim=-1)
    tgt = torch.tensor(output_ids)
    return lp.gather(1, tgt[:, None])[:, 0].tolist(), lp.argmax(-1).tolist()
