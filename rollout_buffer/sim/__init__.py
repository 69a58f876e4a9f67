"""The simulated SGLang engine (`engine`, `server`) and its scripted task policies (`policy`).

A stand-in for GPU engines in demos, tests and benchmarks; the service never imports it.
May import: `generation.tokenizer` (the bundled tokenizer), nothing else of the service.
"""
