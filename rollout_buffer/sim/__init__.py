"""The simulated SGLang engine (`engine`, `server`), its scripted task policies (`policy`) and SGLang's
tool-call handling of chat requests (`tool_calls`).

A stand-in for GPU engines in demos, tests and benchmarks; the service never imports it.
May import: `generation.tokenizer` (the bundled tokenizer), nothing else of the service.
"""
