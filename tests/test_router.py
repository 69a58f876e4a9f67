"""The real sglang-router (Rust, CPU) on loopback in front of two sim engines, with the buffer behind it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ops_helpers import math_rows, scrape, start_run, value, write_jsonl
from prometheus_client.parser import text_string_to_metric_families
from runs import drain, wait_finished
from servers import Server, free_port, running, sglang_router

pytest.importorskip("sglang_router")


@pytest.fixture(scope="module")
def engines(tmp_path_factory, qwen_tokenizer_path: str) -> Iterator[list[Server]]:
    tmp = tmp_path_factory.mktemp("engines")
    with contextlib.ExitStack() as stack:
        servers = []
        for name in ("a", "b"):
            port = free_port()
            args = ["sim-engine", "--port", str(port), "--tokenizer", qwen_tokenizer_path, "--latency-ms", "5"]
            servers.append(stack.enter_context(running(args, "/health", port, tmp / f"sim-{name}.log")))
        yield servers


def generate_count(engine: Server) -> int:
    return httpx.get(f"{engine.url}/sim/stats", timeout=10).json()["by_endpoint"].get("/generate", 0)


def router_requests(metrics_url: str, path: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "smg_http_requests_total" and s.labels.get("path") == path)


def test_math_rollout_through_the_router_reaches_both_engines(
    tmp_path: Path, engines: list[Server], qwen_tokenizer, qwen_tokenizer_path: str
) -> None:
    before = [generate_count(e) for e in engines]
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(5))
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    with sglang_router([e.url for e in engines], tmp_path / "router.log") as (router_url, router_metrics), \
            running(args, "/healthz", port, tmp_path / "buffer.log") as buffer:
        start_run(buffer.url, router_url, inp, qwen_tokenizer_path)
        status = wait_finished(buffer.url)
        records = drain(buffer.url)
        ours = scrape(buffer.url)
        through_router = router_requests(router_metrics, "/generate")

    served = [generate_count(e) - b for e, b in zip(engines, before, strict=True)]
    assert status["run"]["progress"]["done"] == 20 and status["run"]["progress"]["failed"] == 0
    assert sum(served) == 20 == through_router == value(ours, "rollout_buffer_engine_request_seconds_count",
                                                        endpoint="/generate")
    assert all(n > 0 for n in served), f"round robin must use both engines: {served}"
    # The buffer only knows the router; what it gets back through it is still exact token data.
    im_end = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(records) == 20
    for r in records:
        assert r["extra_info"]["engines"] == [router_url]
        n = r["response_length"]
        assert len(r["tokens"]) == len(r["loss_mask"]) and len(r["rollout_log_probs"]) == n
        generated = [t for t, m in zip(r["tokens"][-n:], r["loss_mask"][-n:], strict=True) if m == 1]
        assert generated[-1] == im_end
        assert qwen_tokenizer.decode(generated[:-1]) == r["messages"][-1]["content"]
