"""Safe by default: each attack of a web page, another local user, an agent or a poisoned value, tried against real
`rollout-buffer serve` processes started as the docs say (the default policy: no `--allow-*` flag, no token), and
what each switch of the policy allows.

Every refusal answers in the caller's protocol, names the option or header at fault and what would allow it; nothing
is stored, started or fetched, and the server keeps serving.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from readable import readable_copies
from servers import Server, free_port, sim_engine

from rollout_buffer.media.image_fetch import url_host_allowed
from rollout_buffer.policy import Policy, PolicyRefused

ROOT = Path(__file__).resolve().parent.parent
AGENTS = ROOT / "generators" / "data" / "agents"
SECRET = "sk-do-not-leak-4f1c"


def serve(folder: Path, *flags: str, name: str = "buffer") -> Server:
    """`serve` as the README starts it (its default policy unless `flags` allow more), its store in `folder`."""
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(folder / f"{name}-data"), *flags]
    return Server(args, "/healthz", port, folder / f"{name}.log", trusting=False).start()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("security")


@pytest.fixture(scope="module")
def engine(folder: Path, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(folder, qwen_tokenizer_path) as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(folder: Path) -> Iterator[Server]:
    """A buffer with the default policy."""
    srv = serve(folder)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def math_rows(folder: Path) -> Path:
    rows = folder / "inputs" / "math.jsonl"
    rows.parent.mkdir()
    rows.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n"
                            for i in range(2)))
    return rows


def post(srv: Server, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, headers=headers, timeout=60)


def refused(answer: httpx.Response, status: int, *words: str) -> str:
    assert answer.status_code == status, answer.text
    message: str = answer.json()["message"]
    assert answer.json()["success"] is False and all(w in message for w in words), message
    return message


def no_run(srv: Server) -> None:
    status = httpx.get(f"{srv.url}/status", timeout=10).json()
    assert status["run"] is None, status


# ---- web pages ------------------------------------------------------------------------------------------------------

def test_a_cross_site_form_cannot_start_a_run(buffer: Server, folder: Path, engine: Server,
                                              qwen_tokenizer_path: str) -> None:
    """The attack of a page the user opens: a form post (text/plain) from another origin, naming a host."""
    marker = folder / "pwned"
    attack = json.dumps({"task_type": "agent", "agent_command": ["sh", "-c", f"id > {marker}"], "agent_user": "root",
                         "agent_network": "host", "input_file": str(AGENTS.parent / "math_demo.jsonl"),
                         "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path})
    for headers in ({"content-type": "text/plain", "origin": "http://evil.example", "host": "evil.example"},
                    {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
                    {"content-type": "multipart/form-data; boundary=b"}):
        answer = httpx.post(f"{buffer.url}/start_rollout", content=attack, headers=headers, timeout=10)
        refused(answer, 415, "application/json")
    # JSON from a foreign page (fetch with a preflight the server never answers), or by a rebound name.
    for headers in ({"origin": "http://evil.example"}, {"origin": "null"}, {"origin": "http://evil.example",
                                                                             "host": "evil.example:80"}):
        refused(post(buffer, "/start_rollout", json.loads(attack), **headers), 403, "origin")
    # DNS rebinding: the page's own name now resolves to 127.0.0.1; its reads are refused too.
    for path in ("/status", "/groups", "/metrics", "/ui/api/runs", "/trajectories/x"):
        refused(httpx.get(f"{buffer.url}{path}", headers={"host": "evil.example:8889"}, timeout=10), 403,
                "host", "--allowed-host")
    refused(post(buffer, "/start_rollout", json.loads(attack), host="evil.example"), 403, "host")
    assert not marker.exists()
    no_run(buffer)
    # The server's own pages and clients that are not browsers keep working.
    own = f"127.0.0.1:{buffer.port}"
    assert httpx.get(f"{buffer.url}/status", headers={"origin": f"http://{own}", "host": own}).status_code == 200
    assert httpx.get(f"{buffer.url}/ui", headers={"host": "evil.example"}).status_code == 200, "no data in the page"
    assert httpx.get(f"{buffer.url}/healthz", headers={"host": "10.0.0.7:8889"}).status_code == 200


def test_a_token_lets_slime_reach_the_buffer_by_any_name(folder: Path) -> None:
    """slime on another node names the buffer by its cluster address: with the token, the Host check follows it."""
    srv = Server(["serve", "--port", str(port := free_port()), "--data-dir", str(folder / "token-data"),
                  "--auth-token", SECRET], "/healthz", port, folder / "token.log", trusting=False).start()
    try:
        auth = {"authorization": f"Bearer {SECRET}"}
        assert httpx.get(f"{srv.url}/status", headers={**auth, "host": "10.1.2.3:8889"}).status_code == 200
        refused(httpx.get(f"{srv.url}/status", headers={"host": "10.1.2.3:8889"}), 401, "bearer token")
        form = {**auth, "content-type": "text/plain"}
        refused(httpx.post(f"{srv.url}/get_rollout_data", content=b"{}", headers=form), 415, "application/json")
    finally:
        srv.stop()


# ---- the operator decides what runs ---------------------------------------------------------------------------------

PRIVILEGED: list[tuple[str, dict[str, Any], str]] = [
    # (what is named, the payload's own part, the flag the refusal names)
    ("agent", {"task_type": "agent", "agent": f"{AGENTS / 'openai_agent.py'}:agent"}, "--allow-code"),
    ("agent", {"task_type": "agent", "agent": "antigravity:fly"}, "--allow-module antigravity"),
    ("agent_command", {"task_type": "agent", "agent_command": ["sh", "-c", "id"]}, "--allow-code"),
    ("agent_command", {"task_type": "agent", "agent_command": ["/no/such/program"]}, "--allow-code"),
    ("scorer", {"task_type": "agent", "scorer": "os:system"}, "--allow-module os"),
    ("scorer", {"task_type": "agent", "scorer": "/tmp/score.py:score"}, "--allow-code"),
    ("agent_env.NODE_OPTIONS", {"task_type": "agent", "agent_env": {"NODE_OPTIONS": "--import=data:,x"}},
     "--allow-env NODE_OPTIONS"),
    ("agent_user", {"task_type": "agent", "agent_user": "root"}, "--agent-user root"),
    ("agent_network", {"task_type": "agent", "agent_network": "host"}, "--agent-network host"),
    ("agent_workdir_root", {"task_type": "agent", "agent_workdir_root": "/etc"}, "--allow-code"),
    ("agent_image", {"task_type": "agent", "agent_sandbox": "docker", "agent_image": "alpine",
                     "agent_command": ["sh"]}, "--allow-image alpine"),
    ("env_python", {"task_type": "verifiers", "env_id": "x", "env_python": sys.executable}, "--allow-code"),
    ("env_requirements", {"task_type": "verifiers", "env_id": "x", "env_requirements": ["evil-pkg"]},
     "--allow-installs"),
    ("openenv_command", {"task_type": "openenv", "openenv_command": ["sh", "-c", "id", "{port}"]}, "--allow-code"),
    ("openenv_requirements", {"task_type": "openenv", "openenv_command": ["{python}", "-m", "x", "{port}"],
                              "openenv_requirements": ["evil-pkg"]}, "--allow-installs"),
    ("openenv_env.LD_PRELOAD", {"task_type": "openenv", "openenv_url": "http://127.0.0.1:1",
                                "openenv_env": {"LD_PRELOAD": "/tmp/x.so"}}, "--allow-env LD_PRELOAD"),
    ("tool_config_path", {"task_type": "tool_call", "tool_config_path": str(AGENTS.parent / "tools.yaml")},
     "--allow-code"),
    ("input_file", {"task_type": "math", "input_file": "/etc/passwd"}, "--data-root"),
    ("input_file", {"task_type": "math", "input_file": "/no/such/file.jsonl"}, "--data-root"),
    ("tokenizer_path", {"task_type": "math", "tokenizer_path": "/root"}, "--data-root"),
]


@pytest.mark.parametrize(("option", "payload", "flag"), PRIVILEGED,
                         ids=[f"{o}-{i}" for i, (o, _, _) in enumerate(PRIVILEGED)])
def test_every_privileged_option_is_refused_by_default(buffer: Server, engine: Server, math_rows: Path,
                                                       qwen_tokenizer_path: str, option: str, payload: dict[str, Any],
                                                       flag: str) -> None:
    body = {"input_file": str(AGENTS.parent / "math_demo.jsonl"), "remote_engine_url": engine.url,
            "tokenizer_path": qwen_tokenizer_path, **payload}
    answer = post(buffer, "/start_rollout", body)
    message = refused(answer, 403, option, flag)
    assert answer.json()["detail"]["option"] == option, message
    no_run(buffer)
    assert httpx.get(f"{buffer.url}/healthz", timeout=10).status_code == 200


def test_child_environment_variables_come_from_an_allow_list(folder: Path, engine: Server,
                                                             qwen_tokenizer_path: str) -> None:
    """Allowing a program is not allowing what its environment makes it run (`NODE_OPTIONS`, `LD_PRELOAD`...)."""
    with readable_copies([ROOT / "tests" / "agents" / "stdlib_agent.py"], "rb-sec-agent-") as agents:
        srv = serve(folder, "--allow-code", str(agents), "--allow-env", "PROBE_*", name="env")
        try:
            base = {"task_type": "agent", "input_file": str(AGENTS.parent / "tool_call_demo.jsonl"),
                    "agent_command": [str(agents / "stdlib_agent.py")], "remote_engine_url": engine.url,
                    "tokenizer_path": qwen_tokenizer_path}
            for name in ("NODE_OPTIONS", "PYTHONWARNINGS", "BROWSER", "LD_PRELOAD", "PATH", "BASH_ENV", "PYTHONPATH"):
                refused(post(srv, "/start_rollout", {**base, "agent_env": {name: "x"}}), 403,
                        f"agent_env.{name}", f"--allow-env {name}")
            allowed = post(srv, "/start_rollout", {**base, "agent_env": {"PROBE_PORTS": "1"},
                                                   "num_repeat_per_sample": 1})
            assert allowed.status_code == 200, allowed.text
            # The variable's value is the run's secret: /status shows its name, never its value.
            status = httpx.get(f"{srv.url}/status", timeout=10).json()
            assert status["run"]["config"]["agent_env"] == {"PROBE_PORTS": "***"}, status["run"]["config"]
        finally:
            srv.stop()


def test_each_switch_allows_what_it_names_and_nothing_else(folder: Path, engine: Server, math_rows: Path,
                                                           qwen_tokenizer_path: str) -> None:
    policy_file = folder / "policy.yaml"
    policy_file.write_text(f"read: [{math_rows.parent}]\nmodules: [json]\n")
    srv = serve(folder, "--policy", str(policy_file), "--allow-code", str(AGENTS / "openai_agent.py"), name="switch")
    try:
        base = {"remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path, "num_repeat_per_sample": 1}
        math = {**base, "task_type": "math", "input_file": str(math_rows)}
        assert post(srv, "/start_rollout", math).status_code == 200
        agent = {**base, "task_type": "agent", "input_file": str(math_rows)}
        assert post(srv, "/start_rollout", {**agent, "agent": f"{AGENTS / 'openai_agent.py'}:agent"}).status_code == 200
        refused(post(srv, "/start_rollout", {**agent, "agent": f"{AGENTS / 'stdlib_agent.py'}:agent"}), 403, "agent")
        assert post(srv, "/start_rollout", {**agent, "agent": "json:loads"}).status_code == 200, "an allowed module"
        refused(post(srv, "/start_rollout", {**agent, "agent": "jsonx:loads"}), 403, "--allow-module jsonx")
        # `..` and links are resolved before the check: neither leaves an allowed folder.
        link = math_rows.parent / "passwd.jsonl"
        link.symlink_to("/etc/passwd")
        for sneaky in (str(link), f"{math_rows.parent}/../../../../etc/passwd"):
            refused(post(srv, "/start_rollout", {**base, "task_type": "math", "input_file": sneaky}), 403,
                    "input_file", "--data-root")
        # A missing file answers as an existing one outside the roots does; inside them it is a plain 422.
        outside = [refused(post(srv, "/start_rollout", {**base, "task_type": "math", "input_file": p}), 403)
                   for p in ("/etc/hostname", "/etc/no-such-file.jsonl")]
        assert outside[0].replace("/etc/hostname", "X") == outside[1].replace("/etc/no-such-file.jsonl", "X")
        refused(post(srv, "/start_rollout", {**base, "task_type": "math", "input_file": str(math_rows) + ".gone"}), 422,
                "does not exist")
    finally:
        srv.stop()


def test_a_run_the_operator_stopped_allowing_fails_when_it_resumes(folder: Path, engine: Server, math_rows: Path,
                                                                   qwen_tokenizer_path: str) -> None:
    data = ["--data-dir", str(folder / "resume-data")]
    port = free_port()
    first = Server(["serve", "--port", str(port), *data, "--data-root", str(math_rows.parent)], "/healthz", port,
                   folder / "resume.log", trusting=False).start()
    try:
        started = post(first, "/start_rollout", {"task_type": "math", "input_file": str(math_rows),
                                                 "remote_engine_url": f"http://127.0.0.1:{free_port()}",
                                                 "tokenizer_path": qwen_tokenizer_path, "num_repeat_per_sample": 1})
        assert started.status_code == 200, started.text
    finally:
        first.kill9()
    again = Server(["serve", "--port", str(port), *data], "/healthz", port, folder / "resume.log",
                   trusting=False).start()
    try:
        run = httpx.get(f"{again.url}/status", timeout=10).json()["run"]
        assert run["state"] == "failed" and "input_file" in run["error"] and "--data-root" in run["error"], run
    finally:
        again.stop()


def test_the_policy_file_is_checked_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "policy.yaml"
    for text, words in (("read: /data\n", "read must be a list"), ("allow_everything: true\n", "unknown setting"),
                        ("agent_network: none\n", "agent_network must be one of"), ("[1, 2]\n", "a mapping")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=words):
            Policy.from_file(bad)
    answer = subprocess.run([sys.executable, "-m", "rollout_buffer", "serve", "--port", str(free_port()),
                             "--data-dir", str(tmp_path / "d"), "--policy", str(bad)], capture_output=True, text=True,
                            timeout=60)
    assert answer.returncode != 0 and "--policy" in answer.stderr and "Traceback" not in answer.stderr, answer.stderr
    with pytest.raises(PolicyRefused, match=r"--engine-host router\.internal"):
        Policy(engine_hosts=("10.0.0.*",)).check("remote_engine_url", "urls", "http://router.internal:30000")
    assert Policy(engine_hosts=("10.0.0.*",)).check("remote_engine_url", "urls", ["http://10.0.0.5:1"])
    # Images named by URL: fetched from no host unless the file (or --image-url-host) names it.
    good = tmp_path / "images.yaml"
    good.write_text("image_url_hosts: [screens.internal]\n")
    assert Policy.from_file(good).image_url_hosts == ("screens.internal",) and Policy().image_url_hosts == ()
    assert url_host_allowed("http://screens.internal/a.png", ("screens.internal",))
    assert not url_host_allowed("http://screens.internal/a.png", ())
    assert not url_host_allowed("file:///etc/passwd", ("*",)) and not url_host_allowed("http://evil/a", ("screens*",))


def test_the_policy_judges_paths_as_resolved(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    (allowed / "venv" / "bin").mkdir(parents=True)
    (allowed / "venv" / "bin" / "python").symlink_to(sys.executable)  # a venv's interpreter links out of it
    (allowed / "escape").symlink_to("/etc")
    policy = Policy(code_roots=(allowed,))
    assert policy.check("env_python", "program", str(allowed / "venv" / "bin" / "python"))
    assert policy.check("env_paths", "code_paths", [str(allowed / "venv")])
    assert policy.check("agent_workdir_root", "workdir", str(allowed))
    for kind, value in (("code_paths", [str(allowed / "escape")]), ("code_paths", [f"{allowed}/../x"]),
                        ("workdir", "/tmp"), ("program", [f"{allowed}/../bin/python"]),
                        ("code", f"{allowed}/escape/x.py:f")):
        with pytest.raises(PolicyRefused, match="--allow-code"):
            policy.check("option", kind, value)  # type: ignore[arg-type]
    assert policy.check("scorer", "code", "math") == "math", "a built-in name is no code reference"
    assert policy.check("agent_network", "network", None) is None, "a run that names none keeps its own default"
    assert Policy(network="isolated").check("agent_network", "network", None) == "isolated"
    assert policy.check("agent_user", "user", None) is None
    assert Policy(users=("u1", "u2")).check("agent_user", "user", None) == "u1"


# ---- agents and other local users -----------------------------------------------------------------------------------

ESCAPE_AGENT = '''#!/usr/bin/python3
"""Runs as nobody on the host network: tries the admin routes of the buffer that started it, without a token."""
import json, os, urllib.request, urllib.error

base = os.environ["OPENAI_BASE_URL"].split("/sessions/")[0]
key = os.environ["OPENAI_API_KEY"]

def call(method, path, body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method,
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code

found = {
    "start_rollout": call("POST", "/start_rollout", {"task_type": "math", "input_file": "/etc/passwd"}),
    "list_sessions": call("GET", "/sessions"),
    "write": call("POST", "/buffer/write", {"uid": "x", "instance_id": "x", "messages": [], "reward": 1.0}),
    "status": call("GET", "/status"),
    "own_models": call("GET", os.environ["OPENAI_BASE_URL"][len(base):] + "/models",
                       headers={"authorization": "Bearer " + key}),
    "wrong_key": call("GET", os.environ["OPENAI_BASE_URL"][len(base):] + "/models",
                      headers={"authorization": "Bearer wrong"}),
}
# every item's agent reports; a rename makes each report whole when the test reads it
staged = os.path.join(os.environ["REPORT_DIR"], f".report-{os.getpid()}")
with open(staged, "w") as f:
    json.dump(found, f)
os.replace(staged, os.path.join(os.environ["REPORT_DIR"], "report.json"))
'''


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="running agents as another user needs root and setpriv")
def test_an_agent_on_the_host_network_cannot_call_the_admin_routes(folder: Path, engine: Server,
                                                                   qwen_tokenizer_path: str) -> None:
    """Without a token the buffer takes admin requests from its own user alone: an agent running as `nobody` on the
    machine's network (allowed by the operator here) reaches its own session, nothing else."""
    script = folder / "escape_agent.py"
    script.write_text(ESCAPE_AGENT)
    with readable_copies([script], "rb-sec-escape-") as agents:
        report = agents / "out"
        report.mkdir(mode=0o777)
        report.chmod(0o777)
        srv = serve(folder, "--allow-code", str(agents), "--agent-network", "host", "--allow-env", "REPORT_DIR",
                    name="escape")
        try:
            started = post(srv, "/start_rollout", {
                "task_type": "agent", "input_file": str(AGENTS.parent / "tool_call_demo.jsonl"),
                "agent_command": [str(agents / script.name)], "agent_env": {"REPORT_DIR": str(report)},
                "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path, "num_repeat_per_sample": 1,
                "num_epoch": 1})
            assert started.status_code == 200, started.text
            deadline = time.monotonic() + 120
            while not (report / "report.json").exists():
                assert time.monotonic() < deadline, srv.log()[-3000:]
                time.sleep(0.2)
            found = json.loads((report / "report.json").read_text())
        finally:
            srv.stop()
    assert found["start_rollout"] == found["list_sessions"] == found["write"] == found["status"] == 403, found
    assert found["own_models"] == 200 and found["wrong_key"] == 401, found


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_another_local_user_needs_the_token(buffer: Server) -> None:
    probe = ("import sys, urllib.request, urllib.error\n"
             "try:\n    urllib.request.urlopen(sys.argv[1], timeout=10); print(200)\n"
             "except urllib.error.HTTPError as e:\n    print(e.code, e.read().decode())\n")
    answer = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/bin/python3",
                             "-c", probe, f"{buffer.url}/status"], capture_output=True, text=True, timeout=60)
    assert answer.stdout.startswith("403") and "uid 65534" in answer.stdout and "--auth-token" in answer.stdout, \
        answer.stdout + answer.stderr
    assert httpx.get(f"{buffer.url}/status", timeout=10).status_code == 200, "the server's own user needs none"


def test_a_session_key_is_checked_without_a_token(buffer: Server, engine: Server, qwen_tokenizer_path: str) -> None:
    started = post(buffer, "/start_rollout", {"task_type": "agent", "remote_engine_url": engine.url,
                                              "tokenizer_path": qwen_tokenizer_path})
    assert started.status_code == 200, started.text
    try:
        opened = post(buffer, "/sessions", {"instance_id": "keys"}).json()
        models = f"{opened['base_url']}/models"
        for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
            answer = httpx.get(models, headers=headers, timeout=10)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", answer.text
        assert httpx.get(models, headers={"authorization": f"Bearer {opened['api_key']}"}).status_code == 200
        listing = httpx.get(f"{buffer.url}/sessions", timeout=10).json()["sessions"]
        assert listing and all("api_key" not in s for s in listing), "listing sessions never shows their keys"
    finally:
        post(buffer, "/start_rollout", {"task_type": "agent", "remote_engine_url": engine.url})  # replaced


def test_the_network_is_not_served_without_a_token(tmp_path: Path) -> None:
    args = [sys.executable, "-m", "rollout_buffer", "serve", "--host", "0.0.0.0", "--port", str(free_port()),
            "--data-dir", str(tmp_path / "d")]
    answer = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert answer.returncode != 0, answer.stdout
    assert answer.stderr.strip().count("\n") == 0 and "--auth-token" in answer.stderr, answer.stderr
    assert not (tmp_path / "d").exists(), "nothing was made"
    port = free_port()
    srv = Server(["serve", "--host", "0.0.0.0", "--port", str(port), "--data-dir", str(tmp_path / "open"),
                  "--insecure-no-auth"], "/healthz", port, tmp_path / "open.log", trusting=False).start()
    try:
        assert "without --auth-token" in srv.log()
    finally:
        srv.stop()


# ---- outbound requests ----------------------------------------------------------------------------------------------

def test_engine_urls_are_bounded_in_number_scheme_and_host(buffer: Server, folder: Path, math_rows: Path,
                                                           qwen_tokenizer_path: str) -> None:
    bundled = str(AGENTS.parent / "math_demo.jsonl")
    many = [f"http://127.0.0.{i // 250 + 1}:{10000 + i}" for i in range(2000)]
    started = time.monotonic()
    refused(post(buffer, "/start_rollout", {"task_type": "math", "input_file": bundled, "remote_engine_url": many,
                                            "tokenizer_path": qwen_tokenizer_path}), 422, "remote_engine_url", "256")
    assert time.monotonic() - started < 30
    assert httpx.get(f"{buffer.url}/healthz", timeout=5).status_code == 200
    for url in ("file:///etc/passwd", "gopher://x", "http://"):
        refused(post(buffer, "/start_rollout", {"task_type": "math", "input_file": bundled, "remote_engine_url": url}),
                422, "remote_engine_url")
    srv = serve(folder, "--engine-host", "127.0.0.1", name="hosts")
    try:
        refused(post(srv, "/start_rollout", {"task_type": "math", "input_file": bundled,
                                             "remote_engine_url": "http://169.254.169.254/latest"}), 403,
                "remote_engine_url", "--engine-host 169.254.169.254")
        refused(post(srv, "/start_rollout", {"task_type": "search", "input_file": bundled,
                                             "remote_engine_url": "http://127.0.0.1:1",
                                             "search_url": "http://attacker.example/retrieve"}), 403, "search_url")
    finally:
        srv.stop()


def test_a_routers_worker_list_leads_only_to_allowed_hosts(folder: Path) -> None:
    """An engine's answer naming a host outside `--engine-host` is not followed (asked nothing)."""
    import asyncio
    import http.server
    import threading

    from rollout_buffer.engine.limits import probe_engine

    hits: list[str] = []

    class Router(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.headers["host"] + self.path)
            body = {"/get_server_info": {"router_manager": True},
                    "/workers": {"workers": [{"url": f"http://localhost:{self.server.server_address[1]}"}]}}
            payload = json.dumps(body.get(self.path, {"context_length": 77})).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        asyncio.run(probe_engine(url, 5, ("127.0.0.1",)))
        assert not any(h.startswith("localhost") for h in hits), hits
        asyncio.run(probe_engine(url, 5, ("127.0.0.1", "localhost")))
        assert any(h.startswith("localhost") for h in hits), hits
    finally:
        server.shutdown()


# ---- secrets and data at rest ---------------------------------------------------------------------------------------

def test_secrets_stay_out_of_views_logs_and_exports_and_files_are_private(folder: Path, engine: Server,
                                                                          qwen_tokenizer_path: str) -> None:
    with readable_copies([ROOT / "tests" / "agents" / "stdlib_agent.py"], "rb-sec-secret-") as agents:
        srv = serve(folder, "--allow-code", str(agents), "--allow-env", "OPENAI_ORG_KEY", name="secret")
        try:
            started = post(srv, "/start_rollout", {
                "task_type": "agent", "input_file": str(AGENTS.parent / "tool_call_demo.jsonl"),
                "agent_command": [str(agents / "stdlib_agent.py")], "agent_env": {"OPENAI_ORG_KEY": SECRET},
                "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path, "num_repeat_per_sample": 1,
                "agnet_env": {"X": SECRET}})  # a near miss is warned of, its value never shown
            assert started.status_code == 200, started.text
            assert SECRET not in started.text
            views = [httpx.get(f"{srv.url}{p}", timeout=10).text for p in
                     ("/status", "/ui/api/runs", "/metrics", "/groups?limit=10")]
            assert all(SECRET not in v for v in views)
            assert '"OPENAI_ORG_KEY":"***"' in views[0].replace(" ", "")
            deadline = time.monotonic() + 120
            while httpx.get(f"{srv.url}/status", timeout=10).json()["run"]["state"] == "running":
                assert time.monotonic() < deadline
                time.sleep(0.5)
            data = folder / "secret-data"
            exported = subprocess.run([sys.executable, "-m", "rollout_buffer", "export", "--data-dir", str(data),
                                       "--out", "-", "--all"], capture_output=True, text=True, timeout=120)
            assert exported.returncode == 0 and SECRET not in exported.stdout
        finally:
            srv.stop()
    assert SECRET not in srv.log()
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for file in data.glob("buffer.sqlite*"):
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file


# ---- the small ones -------------------------------------------------------------------------------------------------

def test_poisoned_bodies_answer_4xx_naming_the_field(buffer: Server) -> None:
    deep = ('{"uid": "deep", "instance_id": "i", "messages": [], "reward": 0.0, "extra_info": '
            + '{"x": ' * 1000 + "1" + "}" * 1000 + "}")
    for levels in (300, 1000):
        body = deep.replace('{"x": ' * 1000, '{"x": ' * levels).replace("}" * 1000, "}" * levels)
        answer = httpx.post(f"{buffer.url}/buffer/write", content=body, timeout=10,
                            headers={"content-type": "application/json"})
        refused(answer, 422, "extra_info.x.x", f"nested {levels + 1} levels")
    refused(post(buffer, "/ack", {"batch_id": "never-delivered"}), 404, "batch_id")
    slash = {"uid": "run/with/slash:0", "instance_id": "gsm8k/12", "messages": [], "reward": 0.5}
    assert post(buffer, "/buffer/write", slash).status_code == 200
    served = httpx.get(f"{buffer.url}/trajectories/run/with/slash:0", timeout=10)
    assert served.status_code == 200 and served.json()["instance_id"] == "gsm8k/12", served.text
    assert httpx.get(f"{buffer.url}/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize("store", ["empty", "foreign", "not sqlite"])
def test_a_store_that_is_not_the_buffers_is_refused_at_start(tmp_path: Path, store: str) -> None:
    data = tmp_path / "d"
    data.mkdir()
    path = data / "buffer.sqlite"
    if store == "empty":
        path.touch()
    elif store == "foreign":
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE moz_places (id INTEGER)")
    else:
        path.write_bytes(b"not a database at all" * 100)
    before = path.read_bytes()
    answer = subprocess.run([sys.executable, "-m", "rollout_buffer", "serve", "--port", str(free_port()),
                             "--data-dir", str(data)], capture_output=True, text=True, timeout=120)
    assert answer.returncode != 0
    assert answer.stderr.strip().count("\n") == 0, "one line, no traceback: " + answer.stderr
    assert str(path) in answer.stderr and ("not a rollout-buffer store" in answer.stderr
                                           or "not a database" in answer.stderr), answer.stderr
    assert path.read_bytes() == before, "the file is left as it was"
