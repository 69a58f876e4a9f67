"""The OpenAPI document: FastAPI's, made whole.

FastAPI documents the routes it parses; this completes what it cannot see. Bodies parsed by hand carry
pydantic's own `$defs`, which resolve nowhere inside an OpenAPI document: they move to `components/schemas`.
Every refusal is documented in slime's error shape (and the session API's in its protocol's), and links tell
clients (and API fuzzers' stateful phases) where the ids a response carries lead: a session's id to its
endpoints, a record's uid to the trajectory, a batch to its ack.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from rollout_buffer.proxy.anthropic_messages import MessagesBody
from rollout_buffer.proxy.openai_chat import ChatBody
from rollout_buffer.proxy.openai_responses import ResponsesBody
from rollout_buffer.server.bodies import COMPONENTS

_REF_PREFIX = "#/$defs/"
_COMPONENTS = "#/components/schemas/"

ERROR_BODY = {
    "type": "object",
    "title": "ErrorBody",
    "description": "slime's shape for a refusal: `success` false and a message naming the field.",
    "properties": {"success": {"type": "boolean", "const": False}, "message": {"type": "string"}, "detail": {}},
    "required": ["success", "message"],
}
PROTOCOL_ERROR = {
    "type": "object",
    "title": "ProtocolError",
    "description": "The session protocol's own error object (OpenAI's `{error: {...}}`, Anthropic's "
                   "`{type: error, error: {...}}`).",
    "properties": {"error": {"type": "object"}, "type": {"type": "string"}},
    "required": ["error"],
}

# (path, method) of a session endpoint -> (summary, request body schema or None)
_SESSION_ENDPOINTS: dict[tuple[str, str], tuple[str, dict[str, Any] | None]] = {
    ("chat/completions", "post"): ("A turn of the session, OpenAI Chat Completions", ChatBody.model_json_schema()),
    ("responses", "post"): ("A turn of the session, OpenAI Responses", ResponsesBody.model_json_schema()),
    ("messages", "post"): ("A turn of the session, Anthropic Messages", MessagesBody.model_json_schema()),
    ("messages/count_tokens", "post"): ("Anthropic's token count of a request", MessagesBody.model_json_schema()),
    ("models", "get"): ("The session's model (OpenAI's or Anthropic's list shape)", None),
}

# Links: (operation, where the value is in its 200 body) -> [(target operation, its path parameter)]
_SESSION_ID = "$response.body#/session_id"
_LINKS: dict[tuple[str, str], list[tuple[str, str, dict[str, str]]]] = {
    ("/sessions", "post"): [
        *((f"/sessions/{{session_id}}/v1/{p}", m, {"session_id": _SESSION_ID}) for p, m in _SESSION_ENDPOINTS),
        *((f"/sessions/{{session_id}}{p}", m, {"session_id": _SESSION_ID})
          for p, m in (("", "get"), ("/transcript", "get"), ("/finish", "post"), ("/close", "post"),
                       ("/discard", "post"))),
    ],
    ("/buffer/write", "post"): [
        ("/trajectories/{uid}", "get", {"uid": "$response.body#/uid"}),
        ("/ui/api/trajectories/{uid}", "get", {"uid": "$response.body#/uid"}),
        ("/ui/api/trajectories/{uid}/tokens", "get", {"uid": "$response.body#/uid"}),
    ],
}


def install(app: FastAPI) -> None:
    """Serve `complete()` of FastAPI's document as the app's `/openapi.json` (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            app.openapi_schema = complete(doc)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the document


def complete(doc: dict[str, Any]) -> dict[str, Any]:
    """Hoist `$defs`, document the session API, every refusal and the links; every `$ref` then resolves."""
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, model in COMPONENTS.items():
        schemas.setdefault(name, model.model_json_schema(ref_template=_COMPONENTS + "{model}"))
    schemas["ErrorBody"] = ERROR_BODY
    schemas["ProtocolError"] = PROTOCOL_ERROR
    paths: dict[str, Any] = doc.setdefault("paths", {})
    for (endpoint, method), (summary, body) in _SESSION_ENDPOINTS.items():
        op: dict[str, Any] = {
            "summary": summary,
            "operationId": f"session_{endpoint.replace('/', '_')}_{method}",
            "parameters": [{"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "The protocol's answer (server-sent events when `stream` is "
                                                 "true)",
                                  "content": {"application/json": {"schema": {}}, "text/event-stream": {}}}},
        }
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        paths.setdefault(f"/sessions/{{session_id}}/v1/{endpoint}", {})[method] = op
    _hoist_defs(doc, schemas)
    for path, item in paths.items():
        for op in item.values():
            _document_refusals(path, op)
    _add_links(paths)
    return doc


def _hoist_defs(node: Any, schemas: dict[str, Any]) -> None:
    """Move every `$defs` into `components/schemas` and point its references there."""
    if isinstance(node, dict):
        for name, schema in node.pop("$defs", {}).items():
            schemas.setdefault(name, schema)
            _hoist_defs(schema, schemas)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_REF_PREFIX):
            node["$ref"] = _COMPONENTS + ref[len(_REF_PREFIX):]
        for value in list(node.values()):  # hoisting adds to `schemas`, which may be a value of this walk
            _hoist_defs(value, schemas)
    elif isinstance(node, list):
        for value in node:
            _hoist_defs(value, schemas)


def _document_refusals(path: str, op: dict[str, Any]) -> None:
    """Every operation may refuse (4xx: bad input, unknown ids, auth, the body cap) and find the store full
    (503); FastAPI's own 422 schema is replaced by the shape the server really sends."""
    responses: dict[str, Any] = op.setdefault("responses", {})
    if path == "/healthz":
        return
    responses.pop("422", None)
    error = "ProtocolError" if "/v1/" in path else "ErrorBody"
    content = {"application/json": {"schema": {"$ref": _COMPONENTS + error}}}
    responses["4XX"] = {"description": "Refused: the message names the field or the id", "content": content}
    responses["503"] = {"description": "The store (or, for a session, the engine) cannot take it now",
                        "content": content}


def _add_links(paths: dict[str, Any]) -> None:
    for (path, method), targets in _LINKS.items():
        ok = paths[path][method]["responses"].setdefault("200", {"description": "Success"})
        links = ok.setdefault("links", {})
        for target_path, target_method, parameters in targets:
            target = paths.get(target_path, {}).get(target_method)
            if target is None:
                continue
            links[target["operationId"]] = {"operationId": target["operationId"], "parameters": parameters}
