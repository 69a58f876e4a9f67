"""Exact tokens: tokenizer (loading, the bundled Qwen3 tokenizer), conversation (exact tokens beside messages,
marks and forks; it owns one renderer), renderer (a chat template and its tokenizer: renders, encodes, the
template's framing, cached prompts), sequence (tokens, loss mask, log-probs, weight versions), check (tokens and
text compared), hermes (tool calls in Hermes tags), template_sandbox (the templates' jinja sandbox).

May import: engine (the prompt it sends), delivery (weight-version masks), shortcuts, observability.
"""
