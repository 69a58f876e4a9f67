"""An environment worker for verifiers environments: run by the environment's own interpreter, never imported by
the buffer (its venv pins its own `openai`, `mcp`, ...).

    /path/to/env-venv/bin/python -u verifiers_worker.py

It speaks JSON lines: requests on stdin, answers on stdout (the buffer's `EnvWorker`); logs go to stderr. The first
request loads the environment: `{"op": "load", "env": {...}}` with the config verifiers' own loader takes
(`vf.resolve_env_config`: `taskset.id` and its arguments, the agent's harness and runtime). Then, concurrently:
- `{"id", "op": "tasks"}`: the taskset's tasks (position, key, id, name, prompt text);
- `{"id", "op": "episode", "idx", "key", "base_url", "api_key", "model"}`: one episode of task `idx`, its policy the
  OpenAI-compatible endpoint at `base_url` (a buffer session, which captures the exact tokens); the answer holds the
  episode's rewards and metrics as the environment computed them;
- `{"id", "op": "cancel", "target"}`: stop episode `target` (the buffer's time limit).
Only the standard library and verifiers are used here.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import sys
import traceback
from typing import Any

log = logging.getLogger("rollout_buffer.env_worker")
_KEY_VARS = itertools.count()


class Worker:
    """The loaded environment and the episodes in flight."""

    def __init__(self, out: Any):
        self.out = out
        self.env: Any = None
        self.tasks: list[Any] = []
        self.running: dict[str, asyncio.Task[None]] = {}

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message, default=str).encode() + b"\n")
        self.out.flush()

    def load(self, config: dict[str, Any]) -> None:
        import verifiers.v1 as vf
        from verifiers.v1.configs.agent import agent_config_fields

        resolved = vf.resolve_env_config(config)
        for spec in agent_config_fields(resolved).values():
            # verifiers' default runtime is a hosted sandbox; a worker runs its programs beside itself unless told.
            if "runtime" not in spec.model_fields_set:
                spec.runtime = vf.SubprocessConfig()
        self.env = vf.load_environment(resolved)
        if not self.env.taskset.bounded:
            raise ValueError("the taskset is infinite: bound it in its config (e.g. a `take`/`limit` option)")
        self.tasks = list(self.env.taskset)

    def task_list(self) -> list[dict[str, Any]]:
        return [{"idx": i, "key": t.key, "id": t.data.id, "name": t.data.name, "prompt": t.data.prompt_text}
                for i, t in enumerate(self.tasks)]

    async def episode(self, request: dict[str, Any]) -> dict[str, Any]:
        import verifiers.v1 as vf

        idx = request["idx"]
        if not isinstance(idx, int) or not 0 <= idx < len(self.tasks):
            raise ValueError(f"no task at position {idx!r} (the taskset has {len(self.tasks)})")
        task = self.tasks[idx]
        if request.get("key") not in (None, task.key):
            raise ValueError(f"task {idx} changed since it was listed (key {task.key}, expected {request['key']}): "
                             "the environment's dataset is not the one this run started with")
        # The client reads its key from an environment variable only: one variable per episode.
        var = f"ROLLOUT_BUFFER_SESSION_KEY_{next(_KEY_VARS)}"
        os.environ[var] = request["api_key"]
        try:
            ctx = vf.ModelContext(request.get("model") or "policy",
                                  client=vf.EvalClientConfig(base_url=request["base_url"], api_key_var=var))
            episode = await self.env.run_episode(task, ctx)
        finally:
            os.environ.pop(var, None)
        return summary(episode)


def summary(episode: Any) -> dict[str, Any]:
    """What the buffer keeps of an episode: its verdict, and per trace the rewards and metrics as computed."""
    traces = []
    for trace in episode.traces:
        traces.append({
            "id": trace.id,
            "agent": trace.agent.name,
            "trainable": trace.agent.trainable,
            "reward": trace.reward,
            "rewards": {k: (None if r is None else {"score": r.score, "weight": r.weight})
                        for k, r in trace.rewards.items()},
            "metrics": dict(trace.metrics),
            "ok": trace.ok,
            "truncated": trace.is_truncated,
            "stop_condition": trace.stop_condition,
            "is_timeout": trace.is_timeout,
            "errors": [{"type": e.type, "message": e.message} for e in trace.errors],
            "turns": len(trace.calls),
            "info": trace.info,
        })
    return {"ok": episode.ok, "is_timeout": episode.is_timeout, "traces": traces,
            "errors": [{"type": e.type, "message": e.message} for e in episode.errors]}


async def serve(worker: Worker, reader: asyncio.StreamReader) -> None:
    """Answer requests until stdin closes (the buffer stopped the worker, or died)."""

    async def answer(request: dict[str, Any]) -> None:
        rid = str(request["id"])
        try:
            result = await worker.episode(request)
            worker.send({"id": rid, "result": result})
        except asyncio.CancelledError:
            worker.send({"id": rid, "error": "cancelled", "kind": "cancelled"})
        except Exception as e:  # the episode's failure is the buffer's to record, with its reason
            log.warning("episode %s failed: %s", rid, traceback.format_exc())
            worker.send({"id": rid, "error": f"{type(e).__name__}: {e}", "kind": "env_error"})
        finally:
            worker.running.pop(rid, None)

    async with worker.env.serving():
        while line := await reader.readline():
            request = json.loads(line)
            op = request.get("op")
            if op == "episode":
                worker.running[str(request["id"])] = asyncio.create_task(answer(request))
            elif op == "tasks":
                worker.send({"id": request.get("id"), "result": {"tasks": worker.task_list()}})
            elif op == "cancel":
                task = worker.running.get(str(request.get("target")))
                if task is not None:
                    task.cancel()
            else:
                worker.send({"id": request.get("id"), "error": f"unknown op {op!r}", "kind": "protocol"})
        for task in list(worker.running.values()):
            task.cancel()


async def main() -> None:
    # Answers own the real stdout; anything else writing to fd 1 (a tool, a library's print) goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    logging.basicConfig(level=os.environ.get("ROLLOUT_BUFFER_ENV_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = Worker(out)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 * 1024 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    first = await reader.readline()
    try:
        import verifiers.v1  # noqa: F401
    except ImportError as e:
        worker.send({"fatal": f"this interpreter has no verifiers.v1 ({e})", "field": "env_python"})
        return
    try:
        request = json.loads(first)
        if request.get("op") != "load":
            raise ValueError("the first request must be `load`")
        worker.load(request["env"])
    except Exception as e:
        worker.send({"fatal": f"{type(e).__name__}: {e}", "field": "env_id",
                     "traceback": traceback.format_exc()[-4000:]})
        return
    worker.send({"ready": True, "tasks": len(worker.tasks)})
    await serve(worker, reader)


if __name__ == "__main__":
    asyncio.run(main())
