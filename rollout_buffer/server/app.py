"""The HTTP routes: slime's rollout-buffer protocol (`/start_rollout`, `/get_rollout_data`, `/buffer/write`,
`/ack`), the trainer's version (`/trainer_version`) and inspection (`/status`, `/groups`, `/trajectories`,
`/metrics`); the agent proxy's routes are mounted from `proxy_routes`, the dashboard's from `ui_routes`."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import orjson
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer.config import ServerConfig, version
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.encoded import RecordError
from rollout_buffer.delivery.queries import Reader
from rollout_buffer.delivery.retention import Retention
from rollout_buffer.delivery.store import Store, StoreError
from rollout_buffer.delivery.streams import DEFAULT_STREAM, StreamMismatch
from rollout_buffer.delivery.versions import VersionConflict
from rollout_buffer.generation.evaluation import EvalManager, eval_config
from rollout_buffer.generation.executor import Executor, LocalExecutor
from rollout_buffer.generation.inputs import InputFileError, resolve_input_path, validate_file, write_default_input
from rollout_buffer.generation.options import check_engine_options, run_option_defaults
from rollout_buffer.generation.plugins import Generator, discover
from rollout_buffer.generation.run_health import RunHealthOptions
from rollout_buffer.generation.run_manager import RunManager, reads_input
from rollout_buffer.generation.run_policy import check_run
from rollout_buffer.observability import metrics
from rollout_buffer.observability.logs import RefusalLog
from rollout_buffer.policy import PolicyRefused
from rollout_buffer.proxy.manager import SessionError, SessionManager
from rollout_buffer.proxy.worker_launch import LocalLauncher
from rollout_buffer.proxy.worker_pool import SessionWorkers
from rollout_buffer.schemas import (
    AckRequest,
    EvalResultsRequest,
    GetRolloutDataRequest,
    StartEvalRequest,
    StartRolloutRequest,
    TrainerVersionRequest,
    TrajectoryRecord,
)
from rollout_buffer.server import openapi
from rollout_buffer.server.bodies import (
    component,
    describe_errors,
    documented_body,
    error_response,
    input_locations,
    json_response,
    jsonable,
    parse_body,
    validated,
)
from rollout_buffer.server.catch_up import CatchUp
from rollout_buffer.server.guards import Guards
from rollout_buffer.server.middleware import BodyLimitMiddleware, RequestGate
from rollout_buffer.server.proxy_routes import SessionApi, mount_proxy
from rollout_buffer.server.ui_history import RunHistory
from rollout_buffer.server.ui_routes import mount_ui
from rollout_buffer.server.views import evals_view, run_control, run_view, status_view
from rollout_buffer.server.worker_routes import mount_workers
from rollout_buffer.shortcuts import switch as shortcuts
from rollout_buffer.shortcuts.fast_routes import FastRoutes
from rollout_buffer.tokens.tokenizer import hub_id_hint, load_tokenizer, looks_like_hub_id

log = logging.getLogger(__name__)

# `/buffer/write` takes one record, or a list of records written in one transaction.
WRITE_BODY: TypeAdapter[TrajectoryRecord | list[TrajectoryRecord]] = TypeAdapter(
    TrajectoryRecord | list[TrajectoryRecord]
)
GET_BODY: TypeAdapter[GetRolloutDataRequest] = TypeAdapter(GetRolloutDataRequest)
START_BODY: TypeAdapter[StartRolloutRequest] = TypeAdapter(StartRolloutRequest)
EVAL_BODY: TypeAdapter[StartEvalRequest] = TypeAdapter(StartEvalRequest)


def make_executor(config: ServerConfig) -> Executor:
    """The executor `--executor` names; Ray is imported only when asked for."""
    if config.executor == "ray":
        from rollout_buffer.executors.ray_pool import RayExecutor

        return RayExecutor(config.ray_address, config.ray_actors, config.generator_paths, config.buffer_url,
                           config.auth_token)
    return LocalExecutor()


def make_session_workers(config: ServerConfig, executor: Executor) -> SessionWorkers | None:
    """The session workers `--session-workers` asks for: on the Ray cluster with `--executor ray`, else this
    machine's processes."""
    if not config.session_workers:
        return None
    if config.executor == "ray":
        from rollout_buffer.executors.ray_pool import RayExecutor
        from rollout_buffer.executors.ray_session_workers import RayLauncher

        assert isinstance(executor, RayExecutor)
        return SessionWorkers(config, RayLauncher(config, executor))
    return SessionWorkers(config, LocalLauncher(config))


class BufferApp(FastAPI):
    """The buffer's ASGI app (and a session worker's): the agent sessions' own API served before FastAPI's
    middleware stack and router (see `SessionApi`), then the `fast` routes (see `FastRoutes`), everything else by
    FastAPI; all apply the same security checks (`guards`)."""

    def __init__(self, guards: Guards, fast: Iterable[tuple[str, str]] = (), **kwargs: Any):
        super().__init__(**kwargs)
        rest: ASGIApp = functools.partial(FastAPI.__call__, self)
        if fast and shortcuts.enabled():  # otherwise FastAPI's router serves them, as every other route
            rest = FastRoutes(rest, self, fast)
        self.front = SessionApi(rest, self.state, guards)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def answer_errors_as_slime(app: FastAPI) -> None:
    """Answer invalid bodies and records (422 naming the fields), HTTP errors, sessions refused and a store that
    refused (503) in slime's `{"success": false, "message"}` shape: the buffer's routes, and the routes a harness
    calls on a session worker."""

    @app.exception_handler(SessionError)
    async def _session(_: Request, exc: SessionError) -> Response:
        return error_response(exc.status, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        errors = input_locations(exc.errors(), exc.body)
        return error_response(422, "invalid request: " + describe_errors(errors), jsonable(errors))

    # Starlette's class: FastAPI raises it too (e.g. for an unparseable body), not only its own subclass.
    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(StoreError)
    async def _store(_: Request, exc: StoreError) -> Response:
        return error_response(503, f"store unavailable, nothing was written: {exc}")

    @app.exception_handler(RecordError)
    async def _record(_: Request, exc: RecordError) -> Response:
        return error_response(422, str(exc))

    @app.exception_handler(PolicyRefused)
    async def _policy(_: Request, exc: PolicyRefused) -> Response:
        return error_response(403, str(exc), {"option": exc.option, "allow": exc.allow})


def stopping(app: FastAPI) -> None:
    """A stop signal arrived: open long-polls answer now and admission of new work stops, so the server's connections
    close within its grace period; trajectories in flight are stopped by the shutdown and resume at the next start."""
    buffer: RolloutBuffer | None = getattr(app.state, "buffer", None)
    if buffer is not None:
        buffer.close_long_polls()
    runs: RunManager | None = getattr(app.state, "runs", None)
    if runs is not None:
        runs.stop_admission()
    log.info("stopping: open long-polls answered, no new trajectories started")


def create_app(config: ServerConfig) -> FastAPI:
    """Build the FastAPI app; the store opens and the active run resumes at start-up."""
    generators = discover(config.generator_paths)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store(config.db_path, config.max_db_bytes)
        await store.open()
        reader = Reader(config.db_path)  # the dashboard's queries, beside the store thread
        app.state.reader = reader
        buffer = RolloutBuffer(config, store, generators)
        executor = make_executor(config)
        sessions = SessionManager(config, make_session_workers(config, executor))
        runs = RunManager(config, buffer, generators, sessions, executor)
        evals = EvalManager(config, buffer, generators, sessions)
        app.state.buffer = buffer
        app.state.runs = runs
        app.state.evals = evals
        app.state.sessions = sessions
        history = RunHistory(app)
        app.state.history = history
        retention = None if config.prune_delivered_after_s is None else \
            Retention(store, config.prune_delivered_after_s)
        log.info("rollout buffer %s ready on %s (dashboard %s/ui), store in %s; tasks: %s", version(), config.local_url,
                 config.local_url, config.data_dir.resolve(), ", ".join(sorted(generators)))
        sessions.start()
        catch_up = app.state.catch_up = CatchUp([
            ("finishing complete groups", buffer.finish_interrupted),  # a stopped process's: their policy runs now
            ("resuming the run", runs.resume),
            ("restoring agent sessions", lambda: sessions.recover(runs)),  # before serving: their requests find them
            ("resuming evals", evals.resume),
        ])
        await catch_up.start()  # degraded (reads only) while the store refuses the writes it takes
        history.start()
        if retention is not None:
            retention.start()
        try:
            yield
        finally:
            if retention is not None:
                await retention.stop()
            await catch_up.stop()
            await history.stop()
            await sessions.stop()  # first: the runs' harness sessions stay stored instead of being closed
            await evals.shutdown()
            await runs.shutdown()
            await executor.aclose()
            await reader.close()
            await store.close()

    # The security checks, one `Guards` for both layers: FastAPI's middleware and the session API's fast path.
    guards = Guards.of(config)
    app = BufferApp(
        guards,
        # Called once per agent session, and per batch of a session worker's records.
        fast=[("POST", "/sessions"), ("POST", "/workers/records")],
        title="rollout-buffer",
        version=version(),
        description="Asynchronous agent rollout buffer for slime (slime's /start_rollout + /get_rollout_data).",
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimitMiddleware, guards=guards)
    app.add_middleware(RequestGate, guards=guards)
    app.add_middleware(RefusalLog)  # outermost: logs and counts the refusals of every layer inside it

    answer_errors_as_slime(app)

    @app.exception_handler(VersionConflict)
    async def _version(_: Request, exc: VersionConflict) -> Response:
        return error_response(409, str(exc), {"reported": exc.reported, "trainer_version": exc.current})

    @app.exception_handler(StreamMismatch)
    async def _stream(_: Request, exc: StreamMismatch) -> Response:
        return error_response(409, str(exc))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> Response:
        # A bug still answers in slime's shape, and says where it happened.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/healthz", summary="Liveness probe (no auth)")
    async def healthz() -> Response:
        return json_response({"ok": True})

    @app.post(
        "/start_rollout",
        summary="Start (or replace) the rollout run; with mode \"eval\", start evals (as /start_eval)",
        # Parsed by hand: the body is a rollout payload or, with `mode: "eval"`, an eval payload.
        openapi_extra=documented_body(
            {"anyOf": [component(StartRolloutRequest), component(StartEvalRequest)]}, True),
    )
    async def start_rollout(request: Request) -> Response:
        body = parse_body(await request.body())
        if isinstance(body, dict) and body.get("mode") == "eval":
            return await _start_eval(validated(EVAL_BODY, body), request)
        req: StartRolloutRequest = validated(START_BODY, body)
        gen = generators.get(req.task_type)
        if gen is None:
            raise HTTPException(422, f"task_type: unknown {req.task_type!r}; known: {sorted(generators)}")
        if not gen.native:
            for name in ("max_staleness", "max_ready_groups", "regenerate_stale"):
                if getattr(req, name):
                    raise HTTPException(422, f"{name}: needs a native generator (run_rollout(item, ctx)); "
                                             f"{req.task_type!r} posts its own records")
        runs: RunManager = request.app.state.runs
        try:
            payload, path, num_items = await _resolved_input(gen, req.model_dump(mode="json"), request, "input_file")
            if not req.engine_urls():  # every run has an engine client: without one, it would fail once started
                raise ValueError("remote_engine_url: required: the policy engine the run generates with (an SGLang "
                                 "server's URL, a list of them, or an sglang-router's)")
            await runs.executor.check_options(payload)
            RunHealthOptions.from_run(payload)
            # The engines' context length, keys a router would drop; engines that do not answer (yet).
            engine_warnings = await check_engine_options(payload)
        except ValueError as e:  # InputFileError included
            raise HTTPException(422, str(e)) from None
        # A run that only hosts sessions groups them like /buffer/write records unless told otherwise.
        group_size = config.group_size if path is None and "num_repeat_per_sample" not in req.model_fields_set else None
        req = START_BODY.validate_python(payload)  # with the sandbox settings the policy filled in
        run_id = await runs.start(req, path, num_items, group_size)
        message = (f"rollout started for {num_items} tasks" if path is not None
                   else "agent run started: open sessions with POST /sessions")
        answer = {"success": True, "message": message, "run_id": run_id, "num_items": num_items}
        if warnings := [*engine_warnings, *req.near_misses(run_option_defaults())]:
            for warning in warnings:
                log.warning("run %s: %s", run_id, warning)
            answer["warnings"] = warnings
        return json_response(answer)

    async def _resolved_input(gen: Generator, payload: dict[str, Any], request: Request, input_field: str,
                              evaluating: bool = False) -> tuple[dict[str, Any], Path | None, int]:
        """A run's or an eval's settings judged by the server's policy (PolicyRefused: 403) and the generator's own
        checks, with its input file: the one named (which must exist), the generator's own listing, or none (a run
        that only hosts sessions). ValueError naming what is wrong (422)."""
        try:
            payload = {**payload, **check_run(payload, config.policy, gen.module)}
        except PolicyRefused as e:
            if e.option == "tokenizer_path" and looks_like_hub_id(str(payload["tokenizer_path"])):
                raise ValueError(hub_id_hint(str(payload["tokenizer_path"]))) from None
            raise
        check = gen.hook("check_payload")
        if check is not None:  # the generator's own options (it may resolve files: off the loop)
            await asyncio.to_thread(check, payload, config.policy)
        tokenizer = payload.get("tokenizer_path")
        if tokenizer and payload.get("engine_mode") != "chat":  # a run's exact tokens need it to load
            try:
                await asyncio.to_thread(load_tokenizer, str(tokenizer))
            except ValueError as e:
                hint = f"; {hub_id_hint(str(tokenizer))}" if looks_like_hub_id(str(tokenizer)) else ""
                raise ValueError(f"tokenizer_path: {e}{hint}") from None
        if not reads_input(gen, payload):
            return payload, None, 0
        runs: RunManager = request.app.state.runs
        listing = gen.hook("default_input")
        if payload.get("input_file") is None and listing is not None:  # the generator's own dataset
            rows = await listing(payload, True if evaluating else runs.runs_here(gen, payload))
            path = await asyncio.to_thread(write_default_input, config.data_dir, str(payload["task_type"]), rows)
        elif payload.get("input_file") is None:
            raise InputFileError(f"{input_field}: required for task_type {payload['task_type']!r} (only an agent "
                                 "run that hosts sessions, without agent or agent_command, runs without)")
        else:
            path = await asyncio.to_thread(resolve_input_path, str(payload["input_file"]), input_field)
        required = getattr(gen.module, "REQUIRED_FIELDS", ())
        num_items = (await asyncio.to_thread(validate_file, path, required)).num_items
        return payload, path, num_items

    @app.post("/start_eval", summary="Evaluate named datasets at a trainer version, beside the training run")
    async def start_eval(req: StartEvalRequest, request: Request) -> Response:
        return await _start_eval(req, request)

    async def _start_eval(req: StartEvalRequest, request: Request) -> Response:
        evals: EvalManager = request.app.state.evals
        base = await evals.base_config()
        version = await evals.version_for(req)
        resolved: dict[str, tuple[Path, int, dict[str, Any]]] = {}
        for name, spec in req.datasets().items():
            cfg = eval_config(base, req, name, version)
            task = cfg.get("task_type")
            gen = generators.get(task or "")
            if gen is None:
                raise HTTPException(422, f"task_type: unknown {task!r}; known: {sorted(generators)}" if task else
                                    "task_type: required (there is no run to take it from)")
            if not gen.native:
                raise HTTPException(422, f"task_type: evals need a native generator (run_rollout(item, ctx)); "
                                         f"{task!r} posts its own records")
            if not cfg.get("remote_engine_url"):
                raise HTTPException(422, "remote_engine_url: required (there is no run to take it from)")
            try:
                if spec.path is not None:
                    config.policy.readable(f"eval_datasets.{name}.path", spec.path)
                elif gen.hook("default_input") is None:
                    raise ValueError(f"path: required for task_type {task!r} (it has no input of its own)")
                cfg, path, num_items = await _resolved_input(gen, {**cfg, "input_file": spec.path}, request, "path",
                                                             evaluating=True)
            except PolicyRefused as e:
                e.args = (f"eval_datasets.{name}: {e}",)
                raise
            except ValueError as e:  # InputFileError included
                raise HTTPException(422, f"eval_datasets.{name}: {e}") from None
            assert path is not None
            resolved[name] = (path, num_items, cfg)
        started = await evals.start(version, resolved, req.eval_num_process)
        return json_response({"success": True, "message": f"{len(started)} evals at version {version}",
                              "version": version, "evals": started})

    @app.post("/eval_results", summary="Eval summaries (and records), waiting until the evals finish")
    async def eval_results(req: EvalResultsRequest, request: Request) -> Response:
        evals: EvalManager = request.app.state.evals
        found = await evals.results(req.version, req.datasets, req.wait_s)
        if req.datasets is not None:
            missing = sorted(set(req.datasets) - {s.dataset for s in found})
            if missing and req.version is not None:
                raise HTTPException(404, f"datasets: no eval of {missing} at version {req.version}")
        results: dict[str, Any] = {}
        for summary in found:
            entry = summary.as_dict()
            if req.records:
                blobs = await evals.evals.records((summary.dataset, summary.version), summary.n_samples)
                entry["records"] = [orjson.Fragment(b) for b in blobs]
            results.setdefault(summary.dataset, entry)
        finished = bool(found) and all(s.state != "running" for s in found)
        return json_response({"success": finished, "finished": finished, "results": results})

    @app.post(
        "/buffer/write",
        summary="Persist one trajectory, or a list written together (idempotent on uid)",
        # Parsed by hand with orjson: FastAPI's body handling (stdlib json, dependency solving) cost more
        # CPU than storing the record. The schema is documented all the same.
        openapi_extra=documented_body(
            {"anyOf": [component(TrajectoryRecord), {"type": "array", "items": component(TrajectoryRecord)}]}, True),
    )
    async def buffer_write(request: Request) -> Response:
        body = validated(WRITE_BODY, parse_body(await request.body()))
        # A list is one transaction: how a multi-agent episode (records sharing extra_info.episode_id) must
        # arrive, so its group cannot complete with only part of the episode stored.
        records = body if isinstance(body, list) else [body]
        if not records:
            raise HTTPException(422, "body: an empty list writes nothing")
        buffer: RolloutBuffer = request.app.state.buffer
        result = await buffer.write(records)
        answer: dict[str, Any] = {
            "success": True,
            "message": f"{result.inserted} written, {result.duplicates} duplicate uids ignored",
            "written": result.inserted,
            "duplicates": result.duplicates,
        }
        if not isinstance(body, list):
            answer |= {"uid": body.uid, "duplicate": bool(result.duplicates)}
        return json_response(answer)

    @app.post(
        "/get_rollout_data",
        summary="Whole ready groups, oldest first (long-poll, lease/ack)",
        # The body is parsed by hand (slime may send none at all); document its schema anyway.
        openapi_extra=documented_body(component(GetRolloutDataRequest), required=False),
    )
    async def get_rollout_data(request: Request) -> Response:
        # slime's original client may send an empty body: treat it as {}.
        raw = await request.body()
        body = parse_body(raw) if raw.strip() else {}
        req = validated(GET_BODY, body)
        buffer: RolloutBuffer = request.app.state.buffer
        runs: RunManager = request.app.state.runs
        if req.run_id is not None and await buffer.runs.get(req.run_id) is None:
            raise HTTPException(404, f"run_id: no run {req.run_id!r}")
        d = await buffer.deliver(req.max_groups, req.wait_s, req.lease_s, req.ack, request.is_disconnected,
                                 order=req.order, current_version=req.current_version,
                                 stream=req.agent_id or DEFAULT_STREAM, run_id=req.run_id)
        if d.meta_info and (admission := runs.admission()) is not None:
            d.meta_info |= {"admission_state": admission["state"], "groups_ahead": admission["groups_ahead"]}
        message = f"{d.meta_info['num_groups']} groups" if d.success else "no complete group is ready"
        if not d.success and (run := await buffer.runs.get(req.run_id) if req.run_id else await buffer.runs.latest()
                              ) is not None and run.state == "failed":
            message += f"; run {run.run_id} failed: {run.error}"  # a trainer polling on learns why nothing comes
        return json_response(
            {"success": d.success, "message": message,
             # The stored JSON goes out as it is: parsing and re-encoding long token lists costs seconds.
             "data": {"data": [orjson.Fragment(r.blob) for r in d.records], "meta_info": d.meta_info}}
        )

    @app.post("/ack", summary="Acknowledge a leased batch")
    async def ack(req: AckRequest, request: Request) -> Response:
        buffer: RolloutBuffer = request.app.state.buffer
        n = await buffer.ack(req.batch_id, req.agent_id or DEFAULT_STREAM)
        if n is None:
            raise HTTPException(404, f"batch_id: no batch {req.batch_id!r} was delivered")
        return json_response({"success": True, "acked_groups": n})

    @app.post("/trainer_version", summary="The trainer's weight version (it updated weights without fetching)")
    async def trainer_version(req: TrainerVersionRequest, request: Request) -> Response:
        buffer: RolloutBuffer = request.app.state.buffer
        reported = await buffer.report_version(req.current_version, req.rewind, req.agent_id or DEFAULT_STREAM)
        if reported is None:
            raise HTTPException(409, "current_version: there is no rollout run yet to version (start one first; "
                                     "its start payload may carry current_version)")
        run_id, version = reported
        return json_response({"success": True, "run_id": run_id, "trainer_version": version.current,
                              "base_version": version.base, **({"agent_id": req.agent_id} if req.agent_id else {})})

    @app.get("/status", summary="Run, progress, counts, trainer version and admission state")
    async def status(request: Request) -> Response:
        return json_response(await status_view(request.app))

    # `:path`: a uid holds its instance id, which may hold '/'.
    @app.get("/trajectories/{uid:path}", summary="One stored trajectory")
    async def trajectory(uid: str, request: Request) -> Response:
        buffer: RolloutBuffer = request.app.state.buffer
        rec = await buffer.get_record(uid)
        if rec is None:
            raise HTTPException(404, f"uid: no trajectory {uid!r}")
        return json_response(rec)

    @app.get("/groups", summary="Groups by state, newest first (inspection)")
    async def groups(
        request: Request,
        state: Literal["open", "complete", "ready", "leased", "delivered", "filtered"] | None = None,
        run_id: str | None = None,
        limit: int = Query(default=100, ge=1, le=10_000),
    ) -> Response:
        buffer: RolloutBuffer = request.app.state.buffer
        return json_response({"groups": await buffer.reads.list_groups(state, run_id, limit)})

    @app.get("/metrics", summary="Prometheus metrics (text exposition format)",
             responses={200: {"content": {"text/plain": {}, "application/openmetrics-text": {}}}})
    async def prometheus_metrics(request: Request) -> Response:
        buffer: RolloutBuffer = request.app.state.buffer
        runs: RunManager = request.app.state.runs
        groups, run = await buffer.reads.group_counts(), await buffer.runs.latest()
        public = run_view(run.public() if run is not None else None, runs.progress())
        control = await run_control(request.app, public)
        roles = await buffer.role_counts(run.run_id) if run is not None else {}
        sessions: SessionManager = request.app.state.sessions
        body, content_type = metrics.render(groups, public, runs.progress(), request.headers.get("accept", ""), control,
                                            sessions.open_count(), await evals_view(request.app), roles)
        return Response(body, media_type=content_type)

    mount_proxy(app)
    mount_workers(app)
    mount_ui(app)
    openapi.install(app)
    return app
