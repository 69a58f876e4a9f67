"""The agent proxy: per-session OpenAI (`/chat/completions`) and Anthropic (`/messages`) endpoints that capture
exact tokens while any agent talks to the policy.

messages (canonical chat messages, match keys, protocol-neutral errors), replies (the model's output parsed
into text, reasoning and tool calls), adapter + openai + anthropic (one small base, a few hooks per wire
format), tree (a session's branches: continue, fork, new), session (one session's turn pipeline and records),
manager (open, finish, expire; the `SessionHost` generators use).

May import: generation, delivery, observability, config, schemas. Imported by: server (its routes) and the
tools.
"""
