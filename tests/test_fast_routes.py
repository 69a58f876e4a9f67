"""Routes served ahead of FastAPI's router (`shortcuts.fast_routes`): the same middleware, in the same order, the same
exception handlers and the same request as FastAPI's own dispatch gives them. These tests also fail when
Starlette's `user_middleware` or FastAPI's route objects change shape (the module reads both)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer.server.app import BufferApp
from rollout_buffer.server.guards import Guards
from rollout_buffer.shortcuts.fast_routes import FastRoutes


class Tagging:
    """Middleware that records its name in the scope's `layers`, outermost first."""

    def __init__(self, app: ASGIApp, name: str):
        self.app, self.name = app, name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("layers", []).append(self.name)
        await self.app(scope, receive, send)


class Teapot(Exception):
    pass


def make_app() -> BufferApp:
    app = BufferApp(Guards(None, None, 1 << 20), fast=[("POST", "/fast")])
    app.add_middleware(Tagging, name="inner")
    app.add_middleware(Tagging, name="outer")

    @app.exception_handler(Teapot)
    async def _teapot(_: Request, exc: Teapot) -> Response:
        return JSONResponse({"success": False, "message": str(exc)}, 418)

    async def answer(request: Request) -> Response:
        body = await request.json()
        if body.get("raise") == "teapot":
            raise Teapot("short and stout")
        if body.get("raise") == "http":
            raise HTTPException(409, "taken")
        scope = request.scope
        return JSONResponse({"layers": scope["layers"], "route": scope["route"].path, "app": scope["app"] is app,
                             "routed": "router" in scope, "body": body})

    app.post("/fast")(answer)
    app.post("/slow")(answer)
    return app


def post(app: BufferApp, path: str, body: dict[str, Any]) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def test_a_fast_route_is_answered_ahead_of_the_router_inside_the_same_middleware() -> None:
    app = make_app()
    fast, slow = post(app, "/fast", {"n": 1}).json(), post(app, "/slow", {"n": 2}).json()
    assert fast["layers"] == slow["layers"] == ["outer", "inner"]
    assert (fast["route"], fast["app"], fast["body"]) == ("/fast", True, {"n": 1})
    assert slow["route"] == "/slow"
    assert fast["routed"] is False and slow["routed"] is True  # FastAPI's router never saw the fast route


def test_what_a_fast_route_raises_is_answered_by_the_apps_handlers() -> None:
    app = make_app()
    for path in ("/fast", "/slow"):
        teapot = post(app, path, {"raise": "teapot"})
        assert (teapot.status_code, teapot.json()["message"]) == (418, "short and stout")
        taken = post(app, path, {"raise": "http"})
        assert (taken.status_code, taken.json()) == (409, {"detail": "taken"})  # FastAPI's default handler


def test_a_fast_route_must_be_declared_and_take_the_request_alone() -> None:
    app = make_app()
    with pytest.raises(RuntimeError, match="not declared"):
        FastRoutes(app, app, [("POST", "/nowhere")]).build()

    @app.post("/with-params")
    async def with_params(request: Request, n: int) -> Response:
        return Response()

    with pytest.raises(RuntimeError, match="the Request alone"):
        FastRoutes(app, app, [("POST", "/with-params")]).build()
