"""The sockets a server (`serve`, a session worker) listens on: its TCP port, and the agent socket through which
sandboxed agents without a network reach their sessions."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def tcp_listener(host: str, port: int) -> socket.socket:
    """A listening socket on `host:port` (IPv6 for an IPv6 host)."""
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)


# An agent socket's folder: `<temp dir>/rollout-buffer-agents-<pid of its server>-<random>`.
_FOLDER_PREFIX = "rollout-buffer-agents-"


def agent_socket(stack: contextlib.ExitStack) -> tuple[Path, socket.socket] | None:
    """The agent socket: a Unix socket in a fresh folder (removed when `stack` closes) that anyone may connect to;
    the server answers only session endpoints with their keys on it. None (logged) when it cannot be made.

    The folders of servers that died without closing theirs (SIGKILL, an OOM kill) are removed first."""
    remove_orphaned_agent_folders(Path(tempfile.gettempdir()))
    try:
        folder = Path(tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-"))
        stack.callback(shutil.rmtree, folder, True)
        folder.chmod(0o711)
        path = folder / "agents.sock"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        path.chmod(0o666)
    except OSError as e:
        log.warning("no agent socket (%s): sandboxed agents will use the network", e)
        return None
    return path, sock


def remove_orphaned_agent_folders(temp: Path) -> None:
    """Remove the agent-socket folders in `temp` whose server process is gone."""
    for folder in temp.glob(f"{_FOLDER_PREFIX}*-*"):
        pid = folder.name[len(_FOLDER_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True
