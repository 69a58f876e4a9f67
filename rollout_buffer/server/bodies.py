"""JSON in and out: orjson responses in slime's error shape, and bodies parsed by hand with 422s naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, TypeAdapter, ValidationError


def json_response(body: Any, status_code: int = 200) -> Response:
    """A JSON response serialised by orjson."""
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status_code, media_type="application/json")


def error_response(status_code: int, message: str, detail: Any = None,
                   headers: Mapping[str, str] | None = None) -> Response:
    """slime's shape for failures: success false and a message naming the problem (and the headers the refusal
    needs, such as a 405's `Allow`)."""
    body: dict[str, Any] = {"success": False, "message": message}
    if detail is not None:
        body["detail"] = detail
    response = json_response(body, status_code)
    if headers:
        response.headers.update(headers)
    return response


# Request models documented as components of the OpenAPI document (`server.openapi` adds their schemas).
COMPONENTS: dict[str, type[BaseModel]] = {}


def component(model: type[BaseModel]) -> dict[str, str]:
    """A reference to `model`'s schema among the document's components, for `documented_body`."""
    COMPONENTS[model.__name__] = model
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def documented_body(schema: dict[str, Any], required: bool) -> dict[str, Any]:
    """OpenAPI for a JSON body that the route parses by hand (so FastAPI would not list it)."""
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def validated(adapter: TypeAdapter[Any], body: Any) -> Any:
    """Validate a hand-parsed body strictly (no coercion the OpenAPI document does not name); errors surface as
    FastAPI's 422 with `body.<field>` locations."""
    try:
        return adapter.validate_python(body, strict=True)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in errors], body=body) from None


def input_locations(errors: Any, body: Any) -> list[Any]:
    """The errors with each location as it stands in the request: pydantic's union-branch and constraint tags
    (`str`, `constrained-str`, `list[...]`, a model's name) are no keys of the body, so they are left out."""
    return [{**err, "loc": _input_loc(body, err)} for err in errors]


def _input_loc(body: Any, err: Any) -> list[Any]:
    loc = list(err.get("loc", ()))
    if not loc or loc[0] != "body":
        return loc  # a query or path parameter: FastAPI's location is already the request's
    node, out = body, ["body"]
    for i, part in enumerate(loc[1:], 1):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (i == len(loc) - 1 and err.get("type") == "missing"):
            continue
        out.append(part)
    return out


def parse_body(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        # orjson refuses invalid UTF-8 with the same error type, so both surface as 422.
        error = {"loc": ("body",), "msg": f"not valid JSON: {e}", "type": "json_invalid"}
        raise RequestValidationError([error]) from None


def describe_errors(errors: Any) -> str:
    """One line naming every bad field, e.g. `body.reward: Input should be a valid number`.

    A union body (one record or a list) reports every branch; the shape errors of the branch the input
    did not take are left out, and pydantic's branch tags are dropped from the field paths.
    """
    errs = [(_field_path(e.get("loc", ())), e) for e in errors]
    wrong_branch = {"list_type", "model_attributes_type", "dict_type", "model_type"}
    kept = [(loc, e) for loc, e in errs if not (e.get("type") in wrong_branch and loc == ["body"])] or errs
    return "; ".join(f"{'.'.join(loc)}: {e.get('msg', 'invalid')}" for loc, e in kept[:20])


def _field_path(loc: Any) -> list[str]:
    return [str(x) for x in loc if not (isinstance(x, str) and "[" in x)]


def jsonable(errors: Any) -> Any:
    """Validation errors without the raw input and exception objects (which may not serialise)."""
    return [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in errors]
