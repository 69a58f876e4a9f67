"""rollout-buffer: generates agent trajectories against SGLang and serves whole groups to slime.

The rooms, each a sub-package whose docstring says what lives there and what it may import; imports run
one way, top to bottom (`tests/test_layout.py` keeps it so):

    tools/          command line: `rollout-buffer serve | demo | status | export | sim-engine | retriever`
    server/         the HTTP surface: FastAPI app, routes, request bodies, auth and body-size middleware
    generation/     runs: scheduler, generator context, engine client, exact-token conversation, tokenizer
    delivery/       groups and their delivery: SQLite store by concern, group completion, streams, long-poll
    observability/  Prometheus metrics and logging (written to, importing nothing of the service)
    sim/            the simulated SGLang engine and its scripted task policies (a stand-in, not the service)

Two leaf modules any room may import: `config` (the server's settings) and `schemas` (the wire models).
`generator_api` holds every name a generator imports; `python -m rollout_buffer` is the command line.
"""
