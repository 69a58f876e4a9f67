"""A run's weight watch (`engine.weight_watch`) against the simulated engine in this process: a load that swaps the
weights under an unchanged version is seen, a versioned one is not taken for a swap, an engine behind a router is
probed at its workers, and an engine whose answers have no prompt log-probs is reported as one that cannot be
watched."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_buffer.engine.weight_watch import PROBE_TEXT, WeightWatch
from rollout_sim.contract import SimConfig
from rollout_sim.server import create_app

TOLERANCE = 0.05


@pytest.fixture
def sim_apps(tmp_path: Path) -> dict[str, Any]:
    """Two simulated engines, each at an origin of its own (and checkpoint folders b and c to load)."""
    for name in "bc":
        (tmp_path / name).mkdir()
    return {"http://engine-a": create_app(SimConfig()), "http://engine-b": create_app(SimConfig())}


def reaching(apps: dict[str, Any]) -> httpx.AsyncClient:
    """One client reaching each app at its origin, in this process, as the watch reaches engines."""
    return httpx.AsyncClient(mounts={url: httpx.ASGITransport(app=app) for url, app in apps.items()})


async def load(http: httpx.AsyncClient, engine: str, checkpoint: Path, **body: Any) -> None:
    answer = await http.post(f"{engine}/update_weights_from_disk", json={"model_path": str(checkpoint), **body})
    assert answer.json()["success"], answer.text


def test_an_unversioned_load_is_a_swap_and_a_versioned_one_is_not(sim_apps: dict[str, Any], tmp_path: Path) -> None:
    async def scenario() -> None:
        async with reaching(sim_apps) as http:
            await scenario_with(http)

    async def scenario_with(http: httpx.AsyncClient) -> None:
        watch = WeightWatch(["http://engine-a"], 60.0, TOLERANCE)
        assert await watch.probe(http) == [] and await watch.probe(http) == []
        assert watch.snapshot()["engines"]["http://engine-a"] == {"version": "default", "probes": 2, "spread": 0.0}

        await load(http, "http://engine-a", tmp_path / "b", weight_version="1")
        assert await watch.probe(http) == []  # new weights, and the engine says so

        await load(http, "http://engine-a", tmp_path / "c")  # new weights under version "1" still
        [swap] = await watch.probe(http)
        assert swap.engine == "http://engine-a" and swap.version == "1" and swap.moved > TOLERANCE
        assert swap.after < swap.seen
        view = watch.snapshot()
        assert view["unversioned_swaps"] == 1 and view["swaps"][0]["version"] == "1"
        assert await watch.probe(http) == []  # the new weights are the baseline from then on

    asyncio.run(scenario())


def test_behind_a_router_each_worker_is_probed(sim_apps: dict[str, Any], tmp_path: Path) -> None:
    workers = list(sim_apps)

    async def server_info(_: Request) -> JSONResponse:
        return JSONResponse({"router_manager": True})

    async def listed(_: Request) -> JSONResponse:
        return JSONResponse({"workers": [{"url": w, "is_healthy": True} for w in workers]})

    router = Starlette(routes=[Route("/get_server_info", server_info), Route("/workers", listed)])

    async def scenario() -> None:
        async with reaching({"http://router": router, **sim_apps}) as client:
            watch = WeightWatch(["http://router"], 60.0, TOLERANCE)
            await watch.probe(client)
            await load(client, "http://engine-b", tmp_path / "b")
            [swap] = await watch.probe(client)
        assert swap.engine == "http://engine-b"
        assert set(watch.snapshot()["engines"]) == set(workers)

    asyncio.run(scenario())


def test_an_engine_without_prompt_log_probs_is_said_to_be_unwatchable() -> None:
    seen: list[dict[str, Any]] = []

    async def generate(request: Request) -> JSONResponse:
        seen.append(await request.json())
        return JSONResponse({"text": "x", "output_ids": [1], "meta_info": {"weight_version": "default",
                             "output_token_logprobs": [[-0.5, 1, None]]}})

    old = Starlette(routes=[Route("/generate", generate, methods=["POST"])])

    async def scenario() -> dict[str, Any]:
        async with reaching({"http://old": old}) as client:
            watch = WeightWatch(["http://old"], 60.0, TOLERANCE)
            assert await watch.probe(client) == []
            return watch.snapshot()

    view = asyncio.run(scenario())
    assert "no prompt log-probs" in view["engines"]["http://old"]["cannot"]
    assert seen[0]["text"] == PROBE_TEXT and seen[0]["logprob_start_len"] == 0
    assert seen[0]["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
