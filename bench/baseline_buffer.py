"""The baseline: a minimal process-per-trajectory rollout buffer, built the way slime's original one is.

Written for the benchmarks so the comparison needs no other repository. It keeps the original's design
and nothing more:

- `/start_rollout` starts the generator in a background thread of the server, which forks `num_process`
  worker processes (one OS process per in-flight trajectory);
- each worker takes one repeat of one task at a time and asks the engine with a synchronous OpenAI-style
  chat client (`POST /v1/chat/completions` over httpx, which is what the OpenAI SDK uses underneath), then
  scores the answer with the same math reward as the real generator;
- finished trajectories come back to the server process through a multiprocessing queue and are posted,
  one HTTP request each, to the server's own `/buffer/write` (HTTP write-back);
- `/get_rollout_data` hands out every group that reached `num_repeat_per_sample` records, normalized
  (GRPO), and forgets them (destructive read: no lease, no ack, nothing on disk).

Run: `python -m bench.baseline_buffer --port 18889`.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import socket
import statistics
import threading
from collections.abc import Iterator
from multiprocessing.queues import Queue
from typing import Any

import httpx
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from generators.math import math_reward, prompt_messages

log = logging.getLogger(__name__)

Record = dict[str, Any]
# The chat fields the original generator passes on from slime's sampling params.
_CHAT_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "stop")


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def _tasks(payload: dict[str, Any]) -> Iterator[Record]:
    """Every (task, repeat) of the run, epoch by epoch, as worker inputs."""
    repeats = int(payload.get("num_repeat_per_sample", 8))
    with open(payload["input_file"], "rb") as f:
        items = [orjson.loads(line) for line in f if line.strip()]
    for epoch in range(int(payload.get("num_epoch", 1))):
        for i, item in enumerate(items):
            iid = str(item.get("instance_id", i))
            for repeat in range(repeats):
                yield {**item, "instance_id": iid, "uid": f"{iid}:{epoch}:{repeat}", "epoch": epoch}


def _worker(engine_url: str, sampling: dict[str, Any], tasks: Queue, done: Queue) -> None:
    """One worker process: one trajectory at a time, synchronous chat client, answer scored here."""
    params = {k: sampling[k] for k in _CHAT_KEYS if k in sampling}
    with httpx.Client(base_url=engine_url.rstrip("/") + "/v1", timeout=600.0) as client:
        for item in iter(tasks.get, None):
            messages = prompt_messages(item)
            try:
                answer = client.post("/chat/completions",
                                     json={"model": "default", "messages": messages, **params}).json()
                choice = answer["choices"][0]
                text, finish = choice["message"]["content"] or "", choice["finish_reason"]
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
                log.warning("engine call failed: %s", e)
                text, finish = "", "error"
            done.put({
                "uid": item["uid"],
                "instance_id": item["instance_id"],
                "messages": [*messages, {"role": "assistant", "content": text}],
                "reward": math_reward(text, str(item["label"])) if text else 0.0,
                "extra_info": {"epoch": item["epoch"], "finish_reason": finish, "label": item["label"]},
            })


class ProcessPerTrajectoryGenerator:
    """The original generator's shape: a feeder, `num_process` forked workers, an HTTP write-back loop."""

    def __init__(self, payload: dict[str, Any], buffer_url: str):
        self.payload = payload
        self.buffer_url = buffer_url
        ctx = mp.get_context("fork")
        self.num_process = int(payload.get("num_process", 100))
        self.tasks: Queue = ctx.Queue(maxsize=4 * self.num_process)
        self.done: Queue = ctx.Queue()
        sampling = {**payload.get("sampling_params", {})}
        if payload.get("max_tokens"):
            sampling.setdefault("max_tokens", int(payload["max_tokens"]))
        self.workers = [ctx.Process(target=_worker, args=(payload["remote_engine_url"], sampling, self.tasks,
                                                          self.done), daemon=True)
                        for _ in range(self.num_process)]

    def run(self) -> None:
        """Fork the workers, feed them, and post every finished trajectory to `/buffer/write`."""
        # math-verify builds its LaTeX parser on first use (about a second): once here, shared by every fork.
        math_reward("\\boxed{1}", "1")
        for w in self.workers:
            w.start()
        threading.Thread(target=self._feed, name="feeder", daemon=True).start()
        # TCP_NODELAY, as the original's `requests` sets: without it the separate header and body writes of a
        # sync client wait out delayed ACKs. Keep-alive on (the original opened a connection per record).
        transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        with httpx.Client(base_url=self.buffer_url, timeout=60.0, transport=transport) as client:
            for record in iter(self.done.get, None):
                client.post("/buffer/write", content=orjson.dumps(record),
                            headers={"Content-Type": "application/json"})

    def _feed(self) -> None:
        for task in _tasks(self.payload):
            self.tasks.put(task)
        for _ in self.workers:
            self.tasks.put(None)


class GroupBuffer:
    """Records by group in memory; reads hand out and drop the complete groups."""

    def __init__(self, group_size: int):
        self.group_size = group_size
        self.groups: dict[tuple[str, int], list[Record]] = {}
        self.lock = threading.Lock()
        self.finished_since_read = 0

    def write(self, record: Record) -> None:
        key = (str(record["instance_id"]), int(record.get("extra_info", {}).get("epoch", 0)))
        with self.lock:
            group = self.groups.setdefault(key, [])
            group.append(record)
            self.finished_since_read += len(group) == self.group_size

    def read(self) -> tuple[list[Record], dict[str, Any]]:
        with self.lock:
            ready = [k for k, g in self.groups.items() if len(g) >= self.group_size]
            groups = [self.groups.pop(k) for k in ready]
            finished, self.finished_since_read = self.finished_since_read, 0
        records: list[Record] = []
        for group in groups:
            _normalize(group)
            records.extend(group)
        meta = {"total_samples": len(records), "num_groups": len(groups), "finished_groups": finished}
        return records, meta


def _normalize(group: list[Record]) -> None:
    rewards = [float(r["reward"]) for r in group]
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    for r, raw in zip(group, rewards, strict=True):
        r["raw_reward"] = raw
        r["reward"] = 0.0 if std < 1e-8 else (raw - mean) / (std + 1e-6)


def create_app(port: int) -> FastAPI:
    """The baseline server: `/start_rollout`, `/buffer/write`, `/get_rollout_data`, `/healthz`."""
    app = FastAPI(title="process-per-trajectory baseline")
    state: dict[str, GroupBuffer] = {"buffer": GroupBuffer(8)}

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json({"ok": True})

    @app.post("/start_rollout")
    async def start_rollout(request: Request) -> Response:
        payload = orjson.loads(await request.body())
        state["buffer"] = GroupBuffer(int(payload.get("num_repeat_per_sample", 8)))
        generator = ProcessPerTrajectoryGenerator(payload, f"http://127.0.0.1:{port}")
        threading.Thread(target=generator.run, name="generator", daemon=True).start()
        return _json({"success": True, "message": f"started {generator.num_process} worker processes"})

    @app.post("/buffer/write")
    async def buffer_write(request: Request) -> Response:
        state["buffer"].write(orjson.loads(await request.body()))
        return _json({"success": True})

    @app.post("/get_rollout_data")
    async def get_rollout_data() -> Response:
        records, meta = state["buffer"].read()
        return _json({"success": bool(records), "message": f"{len(records)} records",
                      "data": {"data": records, "meta_info": meta}})

    return app


def main(argv: list[str] | None = None) -> None:
    """Serve the baseline on 127.0.0.1."""
    parser = argparse.ArgumentParser(prog="python -m bench.baseline_buffer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    uvicorn.run(create_app(args.port), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
