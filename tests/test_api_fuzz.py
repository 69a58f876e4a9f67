"""The whole HTTP API fuzzed from its own OpenAPI document (schemathesis), against a buffer with an agent run on
the simulated engine: no request body, parameter or method answers a 5xx, every answer is documented, a
request the document calls invalid is refused, and every `$ref` of the document resolves.

The stateful phase follows the document's links, so session endpoints and trajectories are reached with real
ids. The short form runs in CI; `RB_LONG=1` runs several seeds and many more examples.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import Server, buffer_server, sim_engine

LONG = os.environ.get("RB_LONG") == "1"
FUZZ = Path(__file__).parent / "fuzz"
# The buffer is fuzzed with its default policy (plus the fuzzer's dataset folder) and a token the fuzzer sends on
# every request: a session's API takes the server token like its key, so turns are fuzzed past the key check.
TOKEN = "fuzz-t0ken"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,negative_data_rejection," \
         "unsupported_method"


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        assert isinstance(node, dict) and part in node, f"{ref} resolves nowhere"
        node = node[part]
    return node


class Fuzzed:
    """The buffer under test and the real ids and files the fuzzer draws from (its dictionaries)."""

    def __init__(self, server: Server, sessions: list[str], uids: list[str], files: list[str]):
        self.server, self.sessions, self.uids, self.files = server, sessions, uids, files

    def config(self, path: Path, fail_on: list[str]) -> Path:
        """schemathesis' settings: the warnings that fail the run, and dictionaries of real values so that a path
        parameter or body field names a live session, a stored trajectory or a readable dataset often enough for
        requests to reach past the lookup."""
        values = {"sessions": self.sessions, "uids": self.uids, "files": self.files}
        bindings = {"path.session_id": "sessions", "path.uid": "uids", "query.uid": "uids",
                    "body.input_file": "files"}
        lines = ["[warnings]", f"fail-on = {json.dumps(fail_on)}", "[dictionaries]"]
        lines += [f"{name} = {{ values = {json.dumps(v)} }}" for name, v in values.items()]
        lines += ["[parameters]"]
        lines += [f'"{k}" = {{ dictionary = "{d}", probability = 0.6 }}' for k, d in bindings.items()]
        path.write_text("\n".join(lines) + "\n")
        return path


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Any:
    tmp = tmp_path_factory.mktemp("fuzz")
    data = tmp / "math.jsonl"
    data.write_text("".join(json.dumps({"instance_id": f"m{i}", "prompt": f"What is {i} + 1?", "label": str(i + 1)})
                            + "\n" for i in range(2)))
    with sim_engine(tmp, qwen_tokenizer_path) as engine, \
            buffer_server(tmp, "--group-size", "2", "--data-root", str(tmp), "--auth-token", TOKEN,
                          trusting=False) as srv:
        start = httpx.post(f"{srv.url}/start_rollout", timeout=30, headers=AUTH, json={
            "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path,
            "max_tokens": 64})
        assert start.status_code == 200, start.text
        uids = [f"seed-{k}" for k in range(2)]
        for k, uid in enumerate(uids):
            httpx.post(f"{srv.url}/buffer/write", timeout=30, headers=AUTH, json={
                "uid": uid, "instance_id": "seed", "reward": float(k), "extra_info": {},
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            }).raise_for_status()
        opened = [httpx.post(f"{srv.url}/sessions", timeout=30, headers=AUTH, json={"instance_id": f"fuzz-{k}"}
                             ).json() for k in range(8)]
        sessions = [s["session_id"] for s in opened]
        yield Fuzzed(srv, sessions, uids, [str(data)])


def test_every_ref_of_the_openapi_document_resolves(fuzzed: Fuzzed) -> None:
    doc = httpx.get(f"{fuzzed.server.url}/openapi.json", headers=AUTH).json()
    refs = _refs(doc)
    assert refs, "the document uses components"
    for ref in refs:
        _resolve(doc, ref)
    # The bodies parsed by hand are documented too, by reference into the components.
    write = doc["paths"]["/buffer/write"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "$defs" not in str(doc) and "TrajectoryRecord" in str(write)
    assert {f"/sessions/{{session_id}}/v1/{p}" for p in ("chat/completions", "responses", "messages")} <= set(
        doc["paths"])


def test_request_models_carry_examples(fuzzed: Fuzzed) -> None:
    schemas = httpx.get(f"{fuzzed.server.url}/openapi.json", headers=AUTH).json()["components"]["schemas"]
    for name in ("StartRolloutRequest", "StartEvalRequest", "GetRolloutDataRequest", "TrajectoryRecord"):
        assert schemas[name].get("examples"), name


@pytest.mark.parametrize(("path", "body", "field"), [
    # An eval dataset given as an empty string was a 500 (built into a spec inside the handler).
    ("/start_eval", {"eval_datasets": {"x": ""}}, "eval_datasets.x"),
    ("/start_eval", {"eval_datasets": {"a/b": "data.jsonl"}}, "eval_datasets.a/b"),
    ("/start_rollout", {"mode": "eval", "eval_datasets": {"x": ""}}, "eval_datasets.x"),
    # Request bodies coerce nothing the document does not name: true is no version, "0.5" no wait.
    ("/trainer_version", {"current_version": True}, "current_version"),
    # Versions and counts are the store's 64-bit integers: a larger one was a 500 from SQLite.
    ("/trainer_version", {"current_version": 2**89}, "current_version"),
    ("/ack", {"batch_id": "b", "agent_id": "x" * 129}, "agent_id"),
    ("/get_rollout_data", {"wait_s": "0.5"}, "wait_s"),
    ("/buffer/write", {"uid": "u", "instance_id": "i", "messages": [], "reward": True}, "reward"),
])
def test_refusals_name_the_field(fuzzed: Fuzzed, path: str, body: dict[str, Any], field: str) -> None:
    resp = httpx.post(f"{fuzzed.server.url}{path}", json=body, timeout=30, headers=AUTH)
    assert resp.status_code == 422, resp.text
    assert f"body.{field}:" in resp.json()["message"], resp.json()["message"]


def test_numbers_as_strings_are_taken_as_slime_sends_them(fuzzed: Fuzzed) -> None:
    resp = httpx.post(f"{fuzzed.server.url}/get_rollout_data", timeout=30, headers=AUTH,
                      json={"max_groups": "1", "current_version": "0", "run_id": "nope"})
    assert resp.status_code == 404 and "run_id" in resp.json()["message"]  # validated, then looked up


def test_a_content_part_of_no_known_type_is_a_400_in_the_protocol(fuzzed: Fuzzed) -> None:
    base = f"{fuzzed.server.url}/sessions/{fuzzed.sessions[-1]}/v1"
    chat = httpx.post(f"{base}/chat/completions", timeout=30, headers=AUTH,
                      json={"messages": [{"role": "user", "content": [{"type": {}}]}]})
    assert chat.status_code == 400 and "messages[0].content[0]" in chat.json()["error"]["message"]
    messages = httpx.post(f"{base}/messages", timeout=30, headers=AUTH, json={
        "max_tokens": 16, "messages": [{"role": "user", "content": [{"type": ["text"], "name": ""}]}]})
    assert messages.status_code == 400 and messages.json()["type"] == "error"


# Operations whose valid bodies the document cannot spell out, so that most generated ones are refused with
# reasons: a run's or eval's body names server-side files and generator options; a session's turn follows
# OpenAI's or Anthropic's published message schemas, and a session ends (404 after) once the fuzzer finishes it.
# They are fuzzed with every check all the same; only the "mostly refused" warning does not fail their run.
# (`POST /sessions` goes with them: its links lead the stateful phase to new sessions' endpoints.)
OPEN_ENDED = "^/start_rollout$|^/start_eval$|^/sessions$|^/sessions/\\{session_id\\}/"


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5] if LONG else [1])
@pytest.mark.parametrize("operations", ["exact", "open-ended"])
def test_fuzzed_api_answers_as_documented_and_never_5xx(fuzzed: Fuzzed, tmp_path: Path, seed: int,
                                                        operations: str) -> None:
    st = shutil.which("st") or shutil.which("schemathesis")
    assert st, "schemathesis is part of the test extra"
    exact = operations == "exact"
    # An unresolvable `$ref`, or an operation that refuses most of what its document allows, fails the run.
    fail_on = ["unresolvable_reference", *(["validation_mismatch"] if exact else [])]
    schema = tmp_path / "openapi.json"
    schema.write_bytes(httpx.get(f"{fuzzed.server.url}/openapi.json", headers=AUTH).content)
    out = subprocess.run(
        [st, "--config-file", str(fuzzed.config(tmp_path / "schemathesis.toml", fail_on)), "run",
         str(schema), "--url", fuzzed.server.url, "--exclude-path-regex" if exact else "--include-path-regex",
         OPEN_ENDED, "--checks", CHECKS, "--phases", "examples,coverage,fuzzing,stateful", "--seed", str(seed),
         "--max-examples", "150" if LONG else "25", "--request-timeout", "15", "--workers", "1",
         "--header", f"Authorization: Bearer {TOKEN}"],
        capture_output=True, text=True, timeout=1200, cwd=tmp_path,
        # The long-polls' valid waits are shortened to stay well inside the request timeout (fuzz/hooks.py).
        env={**os.environ, "SCHEMATHESIS_HOOKS": "hooks", "PYTHONPATH": str(FUZZ)},
    )
    assert out.returncode == 0, out.stdout[-8000:] + fuzzed.server.log()[-3000:]
    assert httpx.get(f"{fuzzed.server.url}/healthz").json() == {"ok": True}
    assert httpx.get(f"{fuzzed.server.url}/status", headers=AUTH).status_code == 200
