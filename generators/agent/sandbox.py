"""Where subprocess agents run: a scratch workspace, and pluggable sandboxes that run the agent command in it.

`Workspace`: a private folder per agent (`…/rb-agent-*/work`, owned by the agent's user), holding `item.json`;
removed with everything in it when the agent is done (after scoring).

`LocalSandbox` (the default): a subprocess on this machine, in its own session (killed as a group at the time
limit), its stdout and stderr kept up to a cap, with only the variables given (no inherited environment but
PATH, LANG and LC_ALL). Network (`agent_network`):
- `isolated`: a new network and PID namespace (`unshare --net --pid --kill-child`, plus `--map-root-user` when
  the buffer is not root) holding nothing but loopback; `forward.py`, the namespace's first process, listens on
  127.0.0.1 at the buffer's port and pipes to the buffer's agent socket, which answers only the session
  endpoints, and only with the session's key. So the agent reaches its own session and nothing else: not the
  buffer's other endpoints, not the engine, not the internet. When the agent ends, the kernel kills whatever
  it left behind in the namespace.
- `host`: the machine's network, as the buffer has it (no isolation).
- `auto` (default): `isolated` when `unshare` works here and the server has an agent socket, else `host`.
The agent runs as `agent_user`: by default `nobody` when the buffer runs as root, the buffer's own user
otherwise (switching users needs root). It dies with the process that started it (the buffer, or a Ray actor),
even one killed by SIGKILL (`setpriv --pdeathsig`; isolated: the whole namespace).

`DockerSandbox` (`agent_sandbox: docker`): `docker run --rm --network none` of `agent_image` (never pulled: the
image must be on the engine), as the agent's user with every capability dropped and no privilege gain. Mounted:
the workspace's `work` folder at its own path (read-write, the working directory and HOME), the agent socket and
`forward.py` (read-only). `forward.py` (the container's first process; the image needs `python3` ≥ 3.8, probed
once per run) listens on the container's 127.0.0.1 at the buffer's port and pipes to the agent socket, so the
agent reaches its own session and nothing else. The agent's variables go through the CLI's environment
(`-e NAME`), never its command line. At the time limit the container is killed (`docker kill`) and the CLI
waited for while the engine removes it; `docker rm -f` makes sure. Containers carry the label
`rollout-buffer.agent`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from rollout_buffer.generator_api import fate_shared, scratch_folder

FORWARDER = Path(__file__).with_name("forward.py")
_KEPT_ENV = ("PATH", "LANG", "LC_ALL")
_READ_CHUNK = 65536
_STOP_GRACE_S = 10.0
# The docker sandbox: what its CLI keeps of the buffer's environment, where the forwarder and the agent socket
# are mounted in the container, the label of its containers, how long a CLI call may take.
_DOCKER_ENV = ("HOME", "DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_CONFIG", "DOCKER_CERT_PATH", "DOCKER_TLS_VERIFY")
_FORWARDER_IN = "/run/rollout-buffer/forward.py"
_SOCKET_IN = "/run/rollout-buffer/agents.sock"
_LABEL = "rollout-buffer.agent"
_CLI_TIMEOUT_S = 30.0


class AgentFailed(Exception):
    """The agent did not produce a trajectory; `error_kind` names why (the runner records it as failed)."""

    def __init__(self, kind: str, message: str, info: dict[str, Any] | None = None):
        super().__init__(message)
        self.error_kind = kind
        self.error_info = info or {}  # kept in the failed record's extra_info (the process's exit, its stderr)


@dataclass(frozen=True)
class AgentUser:
    """Who the agent runs as."""

    name: str
    uid: int
    gid: int

    @property
    def switch(self) -> bool:
        """True when the agent runs as another user than the buffer."""
        return self.uid != os.geteuid()


def agent_user(name: str | None) -> AgentUser:
    """The user named by `agent_user`, else `nobody` when running as root, else the buffer's own user."""
    if name is None:
        name = "nobody" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise AgentFailed("agent_sandbox", f"agent_user {name!r} does not exist") from None
    user = AgentUser(name, entry.pw_uid, entry.pw_gid)
    if user.switch and os.geteuid() != 0:
        raise AgentFailed("agent_sandbox", f"running agents as {name!r} needs a buffer running as root")
    return user


def current_user() -> AgentUser:
    """The buffer's own user (in-process agents)."""
    entry = pwd.getpwuid(os.geteuid())
    return AgentUser(entry.pw_name, entry.pw_uid, entry.pw_gid)


class Workspace:
    """A scratch folder for one agent, removed on exit: `root` (the buffer's, mode 0711) holds `work` (the
    agent's, mode 0700, its working directory) with `item.json`."""

    def __init__(self, item_json: bytes, user: AgentUser, parent: str | None = None):
        self.item_json = item_json
        self.user = user
        self.parent = parent
        self.root = Path()
        self.work = Path()

    @property
    def item_file(self) -> Path:
        return self.work / "item.json"

    async def __aenter__(self) -> Workspace:
        await asyncio.to_thread(self._create)
        return self

    def _create(self) -> None:
        self.root = scratch_folder("rb-agent-", self.parent)
        self.root.chmod(0o711)
        self.work = self.root / "work"
        self.work.mkdir(mode=0o700)
        self.item_file.write_bytes(self.item_json)
        if self.user.switch:
            os.chown(self.work, self.user.uid, self.user.gid)
            os.chown(self.item_file, self.user.uid, self.user.gid)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(shutil.rmtree, self.root, True)


@dataclass(frozen=True)
class AgentProcess:
    """One agent command to run."""

    argv: list[str]
    env: dict[str, str]  # the agent's own variables (base URLs, keys, item file), no inherited ones
    stdin: bytes
    workspace: Workspace
    timeout_s: float
    max_output_bytes: int
    network: str  # auto | isolated | host
    agent_socket: str | None
    buffer_url: str  # what the URLs in `env` point at (http://127.0.0.1:PORT)


@dataclass(frozen=True)
class ProcessOutcome:
    """How an agent process ended."""

    exit_code: int | None  # None when it was killed at the time limit
    timed_out: bool
    stdout: str
    stderr: str
    output_truncated: bool
    network: str  # isolated | host | none (container)
    user: str
    duration_s: float


class Sandbox(Protocol):
    """A way to run agent commands."""

    async def run(self, proc: AgentProcess) -> ProcessOutcome:
        """Run the command to its end or its time limit."""
        ...


class _Tail:
    """The last `cap` bytes of a stream, and whether anything was dropped."""

    def __init__(self, cap: int):
        self.cap = cap
        self.data = b""
        self.dropped = False

    async def drain(self, stream: asyncio.StreamReader | None) -> None:
        if stream is None:
            return
        while chunk := await stream.read(_READ_CHUNK):
            self.data += chunk
            if len(self.data) > self.cap:
                self.data, self.dropped = self.data[-self.cap:], True

    def text(self) -> str:
        return self.data.decode(errors="replace")


async def _run_process(argv: list[str], env: dict[str, str], proc: AgentProcess, runs_as: AgentUser, network: str,
                       stop: Callable[[], Awaitable[object]] | None = None) -> ProcessOutcome:
    """Run `argv` in its own session; at the time limit (or on cancellation) call `stop` if given and give the
    process `_STOP_GRACE_S` to end by itself (the docker CLI waits while the engine removes its container),
    then kill its process group."""
    start = time.monotonic()
    child = await asyncio.create_subprocess_exec(
        *argv, cwd=proc.workspace.work, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
    )
    out, err = _Tail(proc.max_output_bytes), _Tail(proc.max_output_bytes)

    async def feed() -> None:
        assert child.stdin is not None
        # An agent may exit (or close its stdin) before reading its row: uvloop then refuses the write with a
        # RuntimeError where asyncio's loop raises BrokenPipeError.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
            child.stdin.write(proc.stdin)
            await child.stdin.drain()
        child.stdin.close()

    io = asyncio.gather(feed(), out.drain(child.stdout), err.drain(child.stderr))
    timed_out = False
    try:
        await asyncio.wait_for(asyncio.shield(child.wait()), proc.timeout_s)
    except TimeoutError:
        timed_out = True
    finally:
        if child.returncode is None:
            if stop is not None:
                await stop()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(child.wait()), _STOP_GRACE_S)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
            await child.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)  # what it left running in its group
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(io, 5.0)  # output of processes that escaped the group is not waited for
    return ProcessOutcome(
        exit_code=None if timed_out else child.returncode, timed_out=timed_out, stdout=out.text(),
        stderr=err.text(), output_truncated=out.dropped or err.dropped, network=network, user=runs_as.name,
        duration_s=time.monotonic() - start,
    )


def _base_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: os.environ[k] for k in _KEPT_ENV if k in os.environ}
    return {**env, **extra}


@functools.lru_cache(maxsize=1)
def namespaces_work() -> bool:
    """True when `unshare` can make network and PID namespaces here (probed once)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    argv = [unshare, "--net", "--pid", "--kill-child", *([] if os.geteuid() == 0 else ["--map-root-user"]), "true"]
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class LocalSandbox:
    """Agents as subprocesses of this machine (see the module docstring)."""

    def __init__(self, user: AgentUser):
        self.user = user

    def network_for(self, requested: str, agent_socket: str | None) -> str:
        """`isolated` or `host` for what the run asked."""
        possible = agent_socket is not None and namespaces_work()
        if requested == "isolated" and not possible:
            why = ("the buffer's agent socket is not on this machine (or the server has none)" if agent_socket is None
                   else "unshare cannot create namespaces here")
            raise AgentFailed("agent_sandbox", f"agent_network isolated is not available: {why}")
        return "isolated" if requested != "host" and possible else "host"

    async def run(self, proc: AgentProcess) -> ProcessOutcome:
        network = self.network_for(proc.network, proc.agent_socket)
        env = _base_env({**proc.env, "HOME": str(proc.workspace.work)})
        if network == "host":
            return await _run_process(_fate_shared(proc.argv, self.user), env, proc, self.user, network)
        port = urlsplit(proc.buffer_url).port or 80
        # The namespace has only loopback, where the forwarder listens: URLs naming the buffer by another
        # address (a Ray actor's `--public-url`) point there instead.
        loopback = f"http://127.0.0.1:{port}"
        env = {k: loopback + v[len(proc.buffer_url):] if v.startswith(proc.buffer_url) else v for k, v in env.items()}
        ids = ["--uid", str(self.user.uid), "--gid", str(self.user.gid)] if self.user.switch else []
        # --kill-child: when unshare dies (with the buffer, see `_fate_shared`), so does the namespace's first
        # process, and with it everything in the namespace.
        argv = [shutil.which("unshare") or "unshare", "--net", "--pid", "--kill-child",
                *([] if os.geteuid() == 0 else ["--map-root-user"]),
                sys.executable, str(FORWARDER), "--socket", str(proc.agent_socket), "--port", str(port), *ids,
                "--", *proc.argv]
        return await _run_process(_fate_shared(argv), env, proc, self.user, network)


def _fate_shared(argv: list[str], user: AgentUser | None = None) -> list[str]:
    """`argv` killed when the process that started it dies and run as `user` when that is another user than the
    buffer's (`fate_shared`). Without setpriv the agent may outlive a crashed buffer (its session is gone, so its
    next request fails)."""
    try:
        return fate_shared(argv, (user.uid, user.gid) if user is not None and user.switch else None)
    except PermissionError as e:
        raise AgentFailed("agent_sandbox", f"running the agent as another user {e}") from None


def _bind(source: str, target: str, read_only: bool = False) -> list[str]:
    """A `--mount` bind (unlike `-v`, a missing source is an error, not a new folder). `--mount` reads its value
    as CSV: the paths are quoted so a comma in them cannot add options."""
    fields = [f"source={source}", f"target={target}"]
    quoted = ['"' + f.replace('"', '""') + '"' for f in fields]
    return ["--mount", ",".join(["type=bind", *quoted, *(["readonly"] if read_only else [])])]


def _install_forwarder(path: Path) -> None:
    """A copy of forward.py the agent's user can read (the package's own may sit in a private folder)."""
    shutil.copyfile(FORWARDER, path)
    path.chmod(0o644)


def docker_cli() -> str:
    """The docker CLI's path; ValueError when it is not installed."""
    docker = shutil.which("docker")
    if docker is None:
        raise ValueError("agent_sandbox: docker needs the docker CLI on the buffer's PATH")
    return docker


def check_image(image: str) -> None:
    """Blocking start-time check: a Docker engine answers and holds `image` (the sandbox never pulls);
    ValueError naming the field otherwise."""
    try:
        done = subprocess.run([docker_cli(), "image", "inspect", "--format", "{{.Id}}", image], env=_cli_env(),
                              capture_output=True, text=True, timeout=_CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"agent_sandbox: the Docker engine did not answer within {_CLI_TIMEOUT_S:g} s") from None
    if done.returncode == 0:
        return
    if "no such image" in done.stderr.lower():
        raise ValueError(f"agent_image: {image!r} is not on the Docker engine (the sandbox never pulls: "
                         "build or pull it first)")
    raise ValueError(f"agent_sandbox: the Docker engine does not answer: {done.stderr.strip()[-300:]}")


def _cli_env(agent: dict[str, str] | None = None) -> dict[str, str]:
    """The docker CLI's environment: what it needs of the buffer's, and the agent's variables (which the CLI
    passes on by name, so their values never show on a command line)."""
    return _base_env({**{k: os.environ[k] for k in _DOCKER_ENV if k in os.environ}, **(agent or {})})


class DockerSandbox:
    """Agents in containers through the docker CLI (see the module docstring)."""

    def __init__(self, user: AgentUser, image: str):
        self.user = user
        self.image = image
        self._problem: str | None = None  # why the image cannot run agents, once probed ("" when it can)
        self._probing = asyncio.Lock()

    async def _docker(self, *args: str, timeout_s: float = _CLI_TIMEOUT_S) -> tuple[int | None, str]:
        """Run a docker CLI command: (exit code, or None when it hung; its stderr)."""
        child = await asyncio.create_subprocess_exec(docker_cli(), *args, env=_cli_env(), stdin=subprocess.DEVNULL,
                                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _, err = await asyncio.wait_for(child.communicate(), timeout_s)
        except TimeoutError:
            child.kill()
            await child.wait()
            return None, f"the docker CLI did not answer within {timeout_s:g} s"
        return child.returncode, err.decode(errors="replace").strip()

    async def _check(self) -> None:
        """The image can run the forwarder: on the engine, with `python3` ≥ 3.8 for the agent's user (probed
        once per run; every row fails with the same `agent_sandbox` reason otherwise)."""
        async with self._probing:
            if self._problem is None:
                try:
                    await asyncio.to_thread(check_image, self.image)
                except ValueError as e:
                    self._problem = str(e)
                else:
                    code, err = await self._docker(
                        "run", "--rm", "--pull", "never", "--label", _LABEL, "--network", "none",
                        "--log-driver", "none", "--user", f"{self.user.uid}:{self.user.gid}",
                        "--entrypoint", "python3", self.image,
                        "-c", "import sys; sys.exit(sys.version_info < (3, 8))")
                    self._problem = "" if code == 0 else (
                        f"agent_image {self.image!r} cannot run python3 >= 3.8 as uid {self.user.uid}, which the "
                        f"sandbox's forwarder needs (exit code {code}): {err[-300:]}")
        if self._problem:
            raise AgentFailed("agent_sandbox", self._problem)

    async def run(self, proc: AgentProcess) -> ProcessOutcome:
        if proc.agent_socket is None:
            raise AgentFailed("agent_sandbox", "the docker sandbox needs the server's agent socket")
        try:
            docker = docker_cli()
        except ValueError as e:
            raise AgentFailed("agent_sandbox", str(e)) from None
        await self._check()
        forwarder = proc.workspace.root / "forward.py"
        await asyncio.to_thread(_install_forwarder, forwarder)
        name = f"rb-agent-{secrets.token_hex(6)}"
        work = str(proc.workspace.work)
        env = {k: v for k, v in proc.env.items() if k != "HOME"}
        argv = [docker, "run", "--rm", "-i", "--pull", "never", "--name", name, "--label", _LABEL,
                "--network", "none", "--log-driver", "none", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges", "--user", f"{self.user.uid}:{self.user.gid}",
                *_bind(work, work), *_bind(proc.agent_socket, _SOCKET_IN, True),
                *_bind(str(forwarder), _FORWARDER_IN, True), "-w", work, "-e", f"HOME={work}",
                *[a for k in env for a in ("-e", k)], "--entrypoint", "python3", self.image,
                _FORWARDER_IN, "--socket", _SOCKET_IN, "--port", str(urlsplit(proc.buffer_url).port or 80),
                "--", *proc.argv]
        try:
            return await _run_process(argv, _cli_env(env), proc, self.user, "none",
                                      stop=functools.partial(self._docker, "kill", name))
        finally:
            # Normally gone already (--rm); this catches a container the killed CLI was still creating.
            await self._docker("rm", "--force", name)
