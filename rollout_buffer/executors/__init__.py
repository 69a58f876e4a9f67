"""Executors that run trajectories outside the buffer process (the `ray` executor's actor pool and its run
options). They implement `generation.executor.Executor` with the generator API of `generation`; they may import
config, schemas, observability, delivery and generation, and only `server` imports them."""
