"""What both wire formats become: canonical chat messages for the chat template, the keys a session matches
histories by, and the protocol-neutral error every adapter renders in its own shape.

Canonical messages are what the tokenizer's chat template takes: `{"role": "system" | "user" | "tool",
"content": str}` and `{"role": "assistant", "content": str, "tool_calls": [{"type": "function", "function":
{"name", "arguments": dict}}]}`. Wire-only fields (tool call ids, `tool_call_id`, cache markers, signatures)
are dropped: the proxy mints new ids for every reply, so they cannot identify a turn.

A match key is what must be equal for an echoed message to be the message the session holds: role, visible
text without surrounding whitespace, and for assistant turns the tool calls as (name, arguments) with the
arguments compared as JSON objects. Reasoning is ignored (clients drop it or send it back in their own
field), so a history the client echoes back in either style continues the session.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import orjson
from pydantic import WithJsonSchema

from rollout_buffer.media.images import IMAGE_REF, data_url_bytes, decoded_base64

# Kinds of refusal → HTTP status; the adapters map the kind onto their protocol's error types.
ERROR_STATUS = {
    "invalid_request": 400,
    "context_length": 400,
    "authentication": 401,
    "permission": 403,
    "not_found": 404,
    "too_large": 413,
    "media_type": 415,
    "server": 500,
    "engine": 503,
    "restoring": 503,
}
IMAGE_PLACEHOLDER = "[image omitted]"
_REASONING = re.compile(r"<think>.*?</think>", re.DOTALL)
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
_IMAGE_PARTS = frozenset({"image", "image_url", "input_image"})

MessageKey = tuple[Any, ...]


class WireError(Exception):
    """A request the proxy refuses or cannot serve: `kind` (a key of ERROR_STATUS), a message naming the
    problem, and the request field at fault when there is one."""

    def __init__(self, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.kind]


def documented_messages(roles: list[str], *blocks: dict[str, Any]) -> WithJsonSchema:
    """The OpenAPI form of a request's `messages`, as `text_of` (and a protocol's own `blocks`) read them: each with
    a role, and its content a string or a list of parts (text, images, anything holding `content`)."""
    parts = [
        {"type": "string"},
        {"type": "object", "required": ["type", "text"],
         "properties": {"type": {"enum": sorted(_TEXT_PARTS)}, "text": {"type": "string"}}},
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": sorted(_IMAGE_PARTS)}}},
        {"type": "object", "required": ["content"]},  # a tool result: its content read the same way
        *blocks,
    ]
    # No content (null or absent) reads as empty text: an assistant turn that only called tools.
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": parts}}, {"type": "null"}]}
    message = {"type": "object", "required": ["role"], "properties": {"role": {"enum": roles}, "content": content}}
    return WithJsonSchema({"type": "array", "minItems": 1, "items": message})


def content_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as the chat template takes it: its text (`text_of`) when it holds no image, else its
    parts in order, text and images. An image part is named by the SHA-256 of its bytes, which it holds for the
    session to take (`PENDING_IMAGE`: checked, stored, the key dropped); WireError naming the part for one that is
    not base64 or names a remote URL."""
    if not isinstance(content, list) or not any(_image_kind(p) for p in content):
        return text_of(content, where)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if _image_kind(part):
            parts.append(_image(part, at))
        elif text := text_of([part], at):
            parts.append({"type": "text", "text": text})
    return parts


# The key of a content part holding an image's bytes and where they came from (`content_of`), until the session
# takes it.
PENDING_IMAGE = "pending"


def _image_kind(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] in _IMAGE_PARTS


def _image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An image part of any protocol (OpenAI's `image_url`, the Responses API's `input_image`, Anthropic's
    `image` with a base64 or URL source, a canonical `image`) as a canonical part holding its bytes."""
    source = part.get("source")
    if isinstance(source, dict):  # Anthropic
        if source.get("type") == "base64":
            data = source.get("data")
            if not isinstance(data, str):
                raise WireError("invalid_request", f"{where}.source.data must be base64", f"{where}.source.data")
            return _held(data, None, where)
        url = source.get("url")
    elif part.get("type") == "image" and isinstance(part.get("image"), str):  # canonical: a hash or the data
        value = part["image"]
        if value.startswith(IMAGE_REF):
            return {"type": "image", "image": value}
        url = value
    else:
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise WireError("invalid_request", f"{where}: an image part needs a data URL or base64 data", where)
    if url.startswith("data:"):
        return _held(None, url, where)
    raise WireError("invalid_request", f"{where}: a remote image URL ({url[:80]}) on a host this server does not "
                    "fetch images from (serve --image-url-host): send the image itself, as a data URL or base64",
                    where)


def _held(data: str | None, url: str | None, where: str) -> dict[str, Any]:
    try:
        raw = decoded_base64(data) if data is not None else data_url_bytes(url or "")
    except ValueError as e:
        raise WireError("invalid_request", f"{where}: {e}", where) from None
    assert raw is not None
    sha = hashlib.sha256(raw).hexdigest()
    return {"type": "image", "image": IMAGE_REF + sha, PENDING_IMAGE: (raw, where)}


def content_key(content: str | list[dict[str, Any]]) -> Any:
    """What must be equal for two contents to be the same: the text without surrounding whitespace, or each
    part's text or image hash in order."""
    if isinstance(content, str):
        return content.strip()
    return tuple(p["image"] if p["type"] == "image" else p["text"].strip() for p in content)


def text_of(content: Any, where: str) -> str:
    """Plain text of a message's content: a string, or a list of parts (text parts joined by newlines, images
    replaced by a placeholder, tool results flattened). WireError naming `where` for anything else."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise WireError("invalid_request", f"{where}: content must be a string or a list of parts", where)
    parts: list[str] = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            parts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):  # a part's type given as an object or list is no type (and unhashable)
            kind = None
        if kind in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise WireError("invalid_request", f"{where}[{i}].text must be a string", f"{where}[{i}].text")
            parts.append(text)
        elif kind in _IMAGE_PARTS:
            parts.append(IMAGE_PLACEHOLDER)
        elif kind == "tool_result" or (isinstance(part, dict) and "content" in part):
            parts.append(text_of(part.get("content"), f"{where}[{i}].content"))
        else:
            raise WireError("invalid_request", f"{where}[{i}]: unsupported content part {kind!r}", f"{where}[{i}]")
    return "\n".join(p for p in parts if p)


def arguments_of(raw: Any, where: str) -> dict[str, Any] | str:
    """A tool call's arguments as a JSON object; a JSON string holding one is decoded, any other string is
    kept as it is (the chat template writes strings verbatim)."""
    if isinstance(raw, dict):
        return raw
    if raw is None:
        return {}
    if isinstance(raw, str):
        if not raw.strip():
            return {}
        try:
            decoded = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
        return decoded if isinstance(decoded, dict) else raw
    raise WireError("invalid_request", f"{where}: arguments must be a JSON object or a string", where)


def tool_call(name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    """A canonical tool call (no id)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def assistant_message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A canonical assistant message; `tool_calls` only when there are calls."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message


def function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    """A tool as the chat template renders it (OpenAI's function-tool shape), checked."""
    if not isinstance(name, str) or not name:
        raise WireError("invalid_request", f"{where}: a tool needs a non-empty string name", where)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise WireError("invalid_request", f"{where}: the tool's parameters must be a JSON schema object", where)
    if description is not None and not isinstance(description, str):
        raise WireError("invalid_request", f"{where}: description must be a string", where)
    return {"type": "function",
            "function": {"name": name, "description": description or "", "parameters": parameters}}


def merge_assistant_runs(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive assistant messages as one (some clients send a reply's text and its tool calls apart)."""
    merged: list[dict[str, Any]] = []
    for m in messages:
        if merged and m["role"] == "assistant" and merged[-1]["role"] == "assistant":
            merged[-1] = merged_assistant(merged[-1], m)
        else:
            merged.append(m)
    return merged


def merged_assistant(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive assistant messages as one: their texts joined by a newline, their tool calls in order."""
    text = "\n".join(t for t in (first["content"], second["content"]) if t)
    return assistant_message(text, [*first.get("tool_calls", ()), *second.get("tool_calls", ())])


def message_key(message: dict[str, Any]) -> MessageKey:
    """What must be equal for two messages to be the same turn (see the module docstring)."""
    role = message["role"]
    if role != "assistant":
        return (role, content_key(message["content"]))
    calls = tuple(
        (c["function"]["name"], _arguments_key(c["function"]["arguments"])) for c in message.get("tool_calls") or ()
    )
    return (role, _REASONING.sub("", message["content"]).strip(), calls)


def _arguments_key(arguments: dict[str, Any] | str) -> bytes | str:
    if isinstance(arguments, dict):
        return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS)
    return arguments


def tools_key(tools: list[dict[str, Any]] | None) -> bytes:
    """The tools of a request as bytes: a session continues only under the same tools (they are in the prompt)."""
    return orjson.dumps(tools or [], option=orjson.OPT_SORT_KEYS)
