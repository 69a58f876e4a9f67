"""The SGLang engine client: client (`EngineClient`: retries, abort and resume, affinity, streaming, weight
versions), sglang_wire (SGLang's request and answer shapes), results (what the client returns and raises, its
counters), limits (an engine's context length, probed, and the engine hosts the operator allows), outage (waiting
out an engine that restarts), http_pool (the client's keep-alive HTTP/1.1).

May import: policy, observability. Knows nothing of runs, records or tokens.
"""
