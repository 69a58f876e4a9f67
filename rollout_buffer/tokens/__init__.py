"""Exact tokens: tokenizer (loading, the bundled Qwen3 tokenizer), conversation (exact tokens beside messages,
marks and forks; it owns the renderer), chat_render (chat templates rendered directly), prompt_ids (a prompt's
ids, rendered and tokenized in one place), sequence (tokens, loss mask, log-probs, weight versions), check
(tokens and text compared), hermes (tool calls in Hermes tags), template_sandbox (the templates' jinja sandbox).

May import: engine (the prompt it sends), delivery (weight-version masks), shortcuts, observability.
"""
