"""Inside an agent's sandbox: forward 127.0.0.1:PORT to the buffer's agent socket, then run the agent.

Standalone on purpose (standard library only, nothing of rollout-buffer): the local sandbox runs it as the first
process of a fresh network (and PID) namespace, where nothing but loopback exists; the container sandbox
mounts a copy read-only and runs it as the container's first process (with the image's `python3`, as the
agent's user already: no --uid / --gid). It brings loopback up, listens on 127.0.0.1:PORT, drops to the agent's
user when started as root, runs the agent command with the inherited stdin / stdout / stderr, pipes every
connection to the Unix socket, and exits with the agent's exit code (128 + N when a signal N ended it).

    python forward.py --socket /path/agents.sock --port 8889 [--uid U --gid G] -- agent args...
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import threading

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_CHUNK = 65536


def loopback_up() -> None:
    """Set `lo` up (a new network namespace starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0)))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


def _copy(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _serve(conn: socket.socket, path: str) -> None:
    with conn, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as upstream:
        try:
            upstream.connect(path)
        except OSError:
            return
        back = threading.Thread(target=_copy, args=(upstream, conn), daemon=True)
        back.start()
        _copy(conn, upstream)
        back.join()


def _accept(server: socket.socket, path: str) -> None:
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_serve, args=(conn, path), daemon=True).start()


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def keep_dying_with_parent() -> None:
    """Set the parent-death signal (SIGKILL) again: the kernel clears it when a process changes its user or
    group, and the sandbox relies on it (`unshare --kill-child`) so that this process, the namespace's first,
    and with it the agent die with the buffer even when the buffer is killed."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        print(f"cannot set the parent-death signal: {os.strerror(ctypes.get_errno())}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--uid", type=int, default=None)
    parser.add_argument("--gid", type=int, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no agent command after --")
    loopback_up()
    server = socket.create_server(("127.0.0.1", args.port))
    if args.gid is not None:
        os.setgroups([])
        os.setgid(args.gid)
    if args.uid is not None:
        os.setuid(args.uid)
    if args.uid is not None or args.gid is not None:
        keep_dying_with_parent()
    threading.Thread(target=_accept, args=(server, args.socket), daemon=True).start()
    try:
        code = subprocess.call(command)
    except OSError as e:
        print(f"cannot run the agent command {command[0]!r}: {e}", file=sys.stderr)
        return 127
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
