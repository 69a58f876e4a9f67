"""The real coding agents from npm, unmodified, through a harness session on the simulated engine: Claude Code
(its default model: mid-conversation system messages, thinking, its own tool set) over the Anthropic endpoint
and Codex over the Responses endpoint, each running a shell command through its own tool. The records hold the
engine's exact ids at loss 1, the tool output and the agent's scaffolding at loss 0, the harness's reward.

The same agents run as an `agent_command` through the wrapper scripts of `generators/data/agents/` (`claude_code.sh`,
`codex.sh`): sandboxed (the agent's user, an isolated network) over an input file, their answers scored.

The programs are installed once at pinned versions into a cache folder (`ROLLOUT_BUFFER_NPM_AGENTS`, default
`~/.cache/rollout-buffer/npm-agents`); the tests skip, saying why, where node or npm is missing."""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from masks import spans
from runs import drain, wait_finished
from servers import Server, buffer_server, session_host, sim_engine
from sessions import assert_engine_tokens, decode_tail, finish, open_session, record, view

from generators.agent.sandbox import namespaces_work

PACKAGES = {"codex": "@openai/codex@0.171.0", "claude": "@anthropic-ai/claude-code@2.1.332"}
VERSIONS = {"codex": "codex-cli 0.171.0", "claude": "2.1.332 (Claude Code)"}
TASK = "Run `ls` and tell me what it printed."
MARKER_FILE = "marker-7f3a.txt"
WRAPPERS = Path(__file__).resolve().parents[1] / "generators" / "data" / "agents"
MARKER = "marker-42"


@pytest.fixture(scope="module")
def npm_agents() -> Path:
    """The folder of the installed agents' executables (`codex`, `claude`), installed there once."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed to install Claude Code and Codex (Debian: apt-get install nodejs npm)")
    root = Path(os.environ.get("ROLLOUT_BUFFER_NPM_AGENTS", Path.home() / ".cache" / "rollout-buffer" / "npm-agents"))
    bin_dir = root / "node_modules" / ".bin"

    def installed() -> bool:
        for name, version in VERSIONS.items():
            exe = bin_dir / name
            if not exe.exists():
                return False
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
            if version not in out.stdout:
                return False
        return True

    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:  # test workers share the folder: one installs, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not installed():
            done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(root),
                                   *PACKAGES.values()], capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            assert installed(), f"npm installed something else than {VERSIONS}"
    return bin_dir


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("coding-sim"), qwen_tokenizer_path) as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory, engine: Server, qwen_tokenizer_path: str) -> Iterator[Server]:
    with session_host(tmp_path_factory.mktemp("coding-buffer"), engine.url, qwen_tokenizer_path,
                      num_repeat_per_sample=1, max_tokens=8192) as srv:
        yield srv


def workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / MARKER_FILE).write_text("hello\n")
    return work


def run_agent(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "SSL_CERT_FILE")}
    done = subprocess.run(argv, cwd=cwd, env={**base, **env}, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{argv[0]} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def check_record(buffer: Server, engine: Server, session: dict[str, Any]) -> dict[str, Any]:
    """One branch of two model turns (the tool call, the answer); the tool's output between them at loss 0."""
    assert [(b["turns"], b["tool_calls"]) for b in view(buffer.url, session)["branches"]] == [(2, 1)]
    stored = finish(buffer.url, session, 0.75)
    rec = record(buffer.url, stored["uids"][0])
    assert rec["status"] == "completed" and rec["extra_info"]["episode_reward"] == 0.75
    assert "tokenization_mismatch" not in rec["extra_info"]
    trained = spans(rec["loss_mask"])
    assert len(trained) == 2
    between = decode_tail(rec["tokens"][trained[0][1]:trained[1][0]])
    assert "<tool_response>" in between and MARKER_FILE in between
    assert MARKER_FILE in decode_tail(rec["tokens"][trained[1][0]:trained[1][1]])
    assert_engine_tokens(engine, rec)
    return rec


def test_claude_code_runs_a_bash_command_through_a_session(npm_agents: Path, buffer: Server, engine: Server,
                                                          tmp_path: Path) -> None:
    session = open_session(buffer.url, "claude-code")
    home = tmp_path / "home"
    home.mkdir()
    out = run_agent([str(npm_agents / "claude"), "-p", TASK, "--allowedTools", "Bash"], workdir(tmp_path), {
        "HOME": str(home), "ANTHROPIC_BASE_URL": session["anthropic_base_url"], "ANTHROPIC_API_KEY": session["api_key"],
        "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})
    assert MARKER_FILE in out
    rec = check_record(buffer, engine, session)
    roles = [m["role"] for m in rec["messages"]]
    assert roles[0] == "system" and "system" in roles[1:], "Claude Code's mid-conversation system message is kept"
    assert httpx.head(f"{session['anthropic_base_url']}", timeout=10).status_code == 200


def test_codex_runs_a_shell_command_through_a_session(npm_agents: Path, buffer: Server, engine: Server,
                                                     tmp_path: Path) -> None:
    session = open_session(buffer.url, "codex")
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(f"""model = "policy"
model_provider = "rollout-buffer"

[model_providers.rollout-buffer]
name = "rollout-buffer"
base_url = "{session['base_url']}"
wire_api = "responses"
env_key = "ROLLOUT_BUFFER_API_KEY"
""")
    out = run_agent([str(npm_agents / "codex"), "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access",
                     TASK], workdir(tmp_path), {"HOME": str(tmp_path), "CODEX_HOME": str(codex_home),
                                                "ROLLOUT_BUFFER_API_KEY": session["api_key"]})
    assert MARKER_FILE in out
    rec = check_record(buffer, engine, session)
    assert rec["extra_info"]["protocols"] == ["responses"]


@pytest.fixture(scope="module")
def wrappers() -> Iterator[Path]:
    """The wrapper scripts in a folder anyone may read: run as `nobody`, they cannot reach a checkout under a
    private folder (a `mktemp -d` clone, /root)."""
    folder = Path(tempfile.mkdtemp(prefix="rb-wrappers-"))
    try:
        folder.chmod(0o755)
        for name in ("claude_code.sh", "codex.sh"):
            shutil.copy(WRAPPERS / name, folder / name)
            (folder / name).chmod(0o755)
        yield folder
    finally:
        shutil.rmtree(folder)


@pytest.fixture(scope="module")
def command_buffer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A buffer of its own: an agent_command run replaces the run the harness tests' buffer holds."""
    with buffer_server(tmp_path_factory.mktemp("coding-commands")) as srv:
        yield srv


def runnable_by_all(program: Path) -> bool:
    """Whether every user may run `program`: the default install folder, under root's private HOME, is not."""
    real = program.resolve()
    return all(p.stat().st_mode & 0o001 for p in [real, *real.parents])


@pytest.mark.parametrize(("wrapper", "program", "protocol"), [("claude_code.sh", "claude", "anthropic"),
                                                              ("codex.sh", "codex", "responses")])
def test_the_wrapper_scripts_run_the_cli_agents_as_an_agent_command(
        npm_agents: Path, wrappers: Path, command_buffer: Server, engine: Server, tmp_path: Path,
        qwen_tokenizer_path: str, wrapper: str, program: str, protocol: str) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b"".join(orjson.dumps({"instance_id": f"echo-{i}", "golden_answers": [MARKER],
                                            "prompt": f"Run `echo {MARKER}` and tell me what it printed."}) + b"\n"
                              for i in range(2)))
    # The agents run as `nobody` when the tests run as root, unless the programs sit where nobody cannot run them.
    user = None if runnable_by_all(npm_agents / program) else pwd.getpwuid(os.geteuid()).pw_name
    started = httpx.post(f"{command_buffer.url}/start_rollout", timeout=60, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path,
        "input_file": str(rows), "num_repeat_per_sample": 1, "max_tokens": 8192,
        "agent_command": [str(wrappers / wrapper)], "agent_user": user,
        "agent_env": {f"{program.upper()}_BIN": str(npm_agents / program)}})
    assert started.status_code == 200, started.text
    status = wait_finished(command_buffer.url, timeout_s=120)
    assert status["run"]["progress"]["failed"] == 0, status["run"]["progress"]
    records = drain(command_buffer.url)
    assert sorted(r["instance_id"] for r in records) == ["echo-0", "echo-1"]
    for rec in records:
        info = rec["extra_info"]
        assert rec["status"] == "completed" and info["protocols"] == [protocol]
        assert info["answer"] == MARKER and rec["raw_reward"] == 1.0, "the answer is the wrapper's last line"
        assert info["agent"]["exit_code"] == 0
        if user is None and os.geteuid() == 0:
            assert info["agent"]["user"] == "nobody"
        if namespaces_work():
            assert info["agent"]["network"] == "isolated"
        trained = spans(rec["loss_mask"])
        assert len(trained) == 2, "the tool call turn and the answer turn"
        between = decode_tail(rec["tokens"][trained[0][1]:trained[1][0]])  # loss 0
        assert MARKER in between.split("<tool_response>", 1)[1].split("</tool_response>", 1)[0], "the command ran"
        assert "tokenization_mismatch" not in info
        assert_engine_tokens(engine, rec)
