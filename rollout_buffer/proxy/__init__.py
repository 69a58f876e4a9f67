"""The agent proxy: per-session OpenAI (`/chat/completions`, `/responses`) and Anthropic (`/messages`) endpoints
that capture exact tokens while any agent talks to the policy.

messages (canonical chat messages, match keys, protocol-neutral errors), history (a resent history converted
only past what the session's previous request held), replies (the model's output parsed into text, reasoning and
tool calls), adapter + openai_chat + openai_responses + anthropic_messages (one small base, a few hooks per wire
format), tree (a session's branches: continue, fork, new), session (one session's turn pipeline and records),
journal + session_files (a harness session's turns on disk, replayed after a restart), manager (open, finish,
expire; the `SessionHost` generators use).

May import: generation, delivery, observability, config, schemas. Imported by: server (its routes) and the
tools.
"""
