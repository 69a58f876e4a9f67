"""The buffer's app: its life (what starts and stops with it), its security checks and error shapes, and its
routes by concern: runs and evals (`run_routes`), slime's delivery protocol (`delivery_routes`), status and
metrics (`status_routes`), agent sessions (`proxy_routes`), session workers (`worker_routes`), the dashboard
(`ui_routes`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer.config import ServerConfig, version
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.encoded import RecordError
from rollout_buffer.delivery.queries import Reader
from rollout_buffer.delivery.retention import Retention
from rollout_buffer.delivery.store import Store, StoreError
from rollout_buffer.delivery.streams import StreamMismatch
from rollout_buffer.delivery.versions import VersionConflict
from rollout_buffer.generation.evaluation import EvalManager
from rollout_buffer.generation.executor import Executor, LocalExecutor
from rollout_buffer.generation.plugins import Generator, discover
from rollout_buffer.generation.run_manager import RunManager
from rollout_buffer.media.image_store import ImageStore
from rollout_buffer.observability.logs import RefusalLog
from rollout_buffer.policy import PolicyRefused
from rollout_buffer.proxy.manager import SessionManager
from rollout_buffer.proxy.session_backend import SessionError
from rollout_buffer.proxy.worker_launch import LocalLauncher
from rollout_buffer.proxy.worker_pool import SessionWorkers
from rollout_buffer.server import delivery_routes, openapi, run_routes, status_routes
from rollout_buffer.server.bodies import (
    describe_errors,
    error_response,
    input_locations,
    json_response,
    jsonable,
)
from rollout_buffer.server.catch_up import CatchUp
from rollout_buffer.server.guards import Guards
from rollout_buffer.server.middleware import BodyLimitMiddleware, RequestGate
from rollout_buffer.server.proxy_routes import SessionApi, mount_proxy
from rollout_buffer.server.ui_history import RunHistory
from rollout_buffer.server.ui_routes import mount_ui
from rollout_buffer.server.worker_routes import mount_workers
from rollout_buffer.shortcuts import switch as shortcuts
from rollout_buffer.shortcuts.fast_routes import FastRoutes

log = logging.getLogger(__name__)

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
        if fast and shortcuts.enabled("fast_routes"):  # otherwise FastAPI's router serves them, as every other route
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


def lifespan_of(config: ServerConfig, generators: dict[str, Generator]
                ) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The buffer's life: the store opened, the run resumed and agent sessions restored at start-up; each part
    stopped in turn at shutdown."""

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
            Retention(store, config.prune_delivered_after_s, ImageStore(config.image_dir))
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

    return lifespan


def answer_conflicts_and_bugs(app: FastAPI) -> None:
    """A trainer's version or stream that conflicts with the run's (409), and a bug (500, logged), in slime's
    shape."""

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


async def healthz() -> Response:
    """Liveness probe."""
    return json_response({"ok": True})


def create_app(config: ServerConfig) -> FastAPI:
    """Build the app: the security checks, slime's error shapes, the routes by concern; the store opens and the
    active run resumes at start-up (`lifespan_of`)."""
    generators = discover(config.generator_paths)
    # The security checks, one `Guards` for both layers: FastAPI's middleware and the session API's fast path.
    guards = Guards.of(config)
    app = BufferApp(
        guards,
        # Called once per agent session, and per batch of a session worker's records.
        fast=[("POST", "/sessions"), ("POST", "/workers/records")],
        title="rollout-buffer",
        version=version(),
        description="Asynchronous agent rollout buffer for slime (slime's /start_rollout + /get_rollout_data).",
        lifespan=lifespan_of(config, generators),
    )
    app.state.config = config
    app.state.generators = generators
    app.add_middleware(BodyLimitMiddleware, guards=guards)
    app.add_middleware(RequestGate, guards=guards)
    app.add_middleware(RefusalLog)  # outermost: logs and counts the refusals of every layer inside it
    answer_errors_as_slime(app)
    answer_conflicts_and_bugs(app)
    app.add_api_route("/healthz", healthz, methods=["GET"], summary="Liveness probe (no auth)")
    app.include_router(run_routes.router)
    app.include_router(delivery_routes.router)
    app.include_router(status_routes.router)
    mount_proxy(app)
    mount_workers(app)
    mount_ui(app)
    openapi.install(app)
    return app
