"""The engine-side ceiling: a bare asyncio client sending the buffer's requests straight to the engine.

No buffer, no tokenization, no reward, no storage: `concurrency` coroutines each send the request the
math generator would send (token mode: `/generate` with the prompt's ids; chat mode:
`/v1/chat/completions` with its messages), one after another, with prepared bodies. What it reaches is
what the engine can answer on this machine, its own CPU cost included.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from bench.workload import MAX_TOKENS, SAMPLING, math_rows
from generators.math import prompt_messages
from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path, load_tokenizer


def request_bodies(mode: str, n: int = 256) -> tuple[str, list[bytes]]:
    """(path, bodies) of the first `n` tasks' engine requests in `mode`."""
    rows = math_rows(n)
    if mode == "chat":
        return "/v1/chat/completions", [
            orjson.dumps({"model": "default", "messages": prompt_messages(r), "max_tokens": MAX_TOKENS, **SAMPLING})
            for r in rows
        ]
    tokenizer = load_tokenizer(bundled_tokenizer_path())
    bodies = []
    for r in rows:
        text = tokenizer.apply_chat_template(prompt_messages(r), tokenize=False, add_generation_prompt=True)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        params = {"max_new_tokens": MAX_TOKENS, **SAMPLING}
        bodies.append(orjson.dumps({"input_ids": prompt, "sampling_params": params, "return_logprob": True}))
    return "/generate", bodies


async def _run(url: str, mode: str, concurrency: int, warmup_s: float, window_s: float,
               on_window: Callable[[], None]) -> dict[str, Any]:
    path, bodies = request_bodies(mode)
    done_at: list[float] = []
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(k: int) -> None:
            i = k
            while not stop.is_set():
                async with session.post(url + path, data=bodies[i % len(bodies)]) as resp:
                    await resp.read()
                    resp.raise_for_status()
                done_at.append(time.monotonic())
                i += concurrency

        workers = [asyncio.create_task(one(k)) for k in range(concurrency)]
        await asyncio.sleep(warmup_s)
        on_window()
        start = time.monotonic()
        await asyncio.sleep(window_s)
        end = time.monotonic()
        stop.set()
        await asyncio.gather(*workers)
    n = sum(1 for t in done_at if start <= t < end)
    return {"requests": n, "window_s": end - start, "rate": n / (end - start)}


def measure(url: str, mode: str, concurrency: int, warmup_s: float, window_s: float,
            on_window: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Requests per second the engine answers a bare client with `concurrency` requests in flight;
    `on_window` is called as the measured window opens (to mark CPU meters)."""
    return asyncio.run(_run(url, mode, concurrency, warmup_s, window_s, on_window))
