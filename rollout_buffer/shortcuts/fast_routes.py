"""Routes the buffer serves ahead of FastAPI's router: those called once per agent session or per batch of a
session worker's records (`POST /sessions`, `POST /workers/records`), where FastAPI's stack costs more than the
route's own work (bench/proxy.py measures the buffer's CPU per proxied turn with session workers).

A fast route is declared like any other, on FastAPI: its OpenAPI entry and its handler, which takes the
`Request` alone. The front calls that handler inside the app's own middleware (the classes and options the app
was given, in its order: the same bearer check, agent socket gate, body cap and refusal log) and answers what it
raises with the app's own exception handlers (looked up by the exception's class, as Starlette does). It sets
the scope's `app` and `route` as FastAPI's router would, so handlers and the refusal log see the same request.
What it skips is FastAPI's per-request machinery: Starlette's error and exception middleware (whose work the
app's handlers do here), the router's pattern matching over every route, dependency solving and the
request/response wrappers.

This module is the only one that reads Starlette's `user_middleware` and FastAPI's route objects;
tests/test_fast_routes.py fails when either changes shape.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Receive, Scope, Send

ExceptionHandler = Callable[[Request, Any], Response | Awaitable[Response]]


class FastRoutes:
    """Serves the routes `wanted` ((method, path) pairs, the path as declared) of `fastapi_app` ahead of it;
    every other request goes on to `app`."""

    def __init__(self, app: ASGIApp, fastapi_app: FastAPI, wanted: Iterable[tuple[str, str]]):
        self.app = app
        self.fastapi = fastapi_app
        self.wanted = frozenset(wanted)
        # Built at the first request: the app's routes and middleware are declared after it is made.
        self.served: dict[tuple[str, str], ASGIApp] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        served = self.served if self.served is not None else self.build()
        layered = served.get((scope["method"], scope["path"]))
        if layered is None:
            await self.app(scope, receive, send)
            return
        await layered(scope, receive, send)

    def build(self) -> dict[tuple[str, str], ASGIApp]:
        """Each wanted route's handler inside the app's middleware. RuntimeError when one is not declared, or
        its handler takes more than the request (FastAPI would have to solve its parameters)."""
        served: dict[tuple[str, str], ASGIApp] = {}
        for route in self.fastapi.routes:
            if not isinstance(route, APIRoute):
                continue
            for method in route.methods or ():
                if (method, route.path) in self.wanted:
                    served[(method, route.path)] = self._layered(route)
        missing = self.wanted - served.keys()
        if missing:
            raise RuntimeError(f"fast routes not declared on the app: {sorted(missing)}")
        self.served = served
        return served

    def _layered(self, route: APIRoute) -> ASGIApp:
        params = list(inspect.signature(route.endpoint).parameters.values())
        if len(params) != 1 or params[0].annotation not in (Request, "Request"):
            raise RuntimeError(f"fast route {route.path}: its handler must take the Request alone")
        endpoint: Callable[[Request], Awaitable[Response]] = route.endpoint
        fastapi_app = self.fastapi

        async def handle(scope: Scope, receive: Receive, send: Send) -> None:
            scope["app"], scope["route"] = fastapi_app, route
            request = Request(scope, receive)
            try:
                response = await endpoint(request)
            except Exception as exc:
                handler = self._handler_of(exc)
                if handler is None:
                    raise
                answer = handler(request, exc)
                response = await answer if inspect.isawaitable(answer) else answer
            await response(scope, receive, send)

        layered: ASGIApp = handle
        for middleware in reversed(fastapi_app.user_middleware):  # the first declared is the outermost
            layered = middleware.cls(layered, *middleware.args, **middleware.kwargs)
        return layered

    def _handler_of(self, exc: Exception) -> ExceptionHandler | None:
        handlers: dict[Any, ExceptionHandler] = self.fastapi.exception_handlers
        for cls in type(exc).__mro__:
            if cls in handlers:
                return handlers[cls]
        return None
