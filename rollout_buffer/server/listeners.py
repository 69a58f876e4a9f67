"""The sockets a server (`serve`, a session worker) listens on: its TCP port, and the agent socket through which
sandboxed agents without a network reach their sessions."""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def tcp_listener(host: str, port: int) -> socket.socket:
    """A listening socket on `host:port` (IPv6 for an IPv6 host)."""
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)


def agent_socket(stack: contextlib.ExitStack) -> tuple[Path, socket.socket] | None:
    """The agent socket: a Unix socket in a fresh folder (removed when `stack` closes) that anyone may connect to;
    the server answers only session endpoints with their keys on it. None (logged) when it cannot be made."""
    try:
        folder = Path(tempfile.mkdtemp(prefix="rollout-buffer-agents-"))
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
