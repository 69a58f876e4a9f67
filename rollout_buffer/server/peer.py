"""Who is on the other end of a loopback TCP connection: the uid that owns the client's socket.

A Unix socket tells its peer (`SO_PEERCRED`); TCP does not, but on loopback both ends are sockets of this
machine's kernel, which knows the owner of each. The kernel is asked through netlink's socket diagnostics
(`NETLINK_SOCK_DIAG`, what `ss` uses) for the one socket whose addresses are the client's: an exact lookup, not
a dump of every socket. Without a server token this is how the buffer tells its own user (and root) from every
other local user, and from agents and environments running as another user (docs/security.md).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_ALL_STATES = 0xFFFFFFFF
_NO_COOKIE = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr
# struct inet_diag_msg: family, state, timer, retrans, sockid (48 bytes), expires, rqueue, wqueue, then uid.
_UID_OFFSET = _HEADER.size + 4 + 48 + 12


def is_loopback(host: str) -> bool:
    """Whether `host` (an address as ASGI's scope reports a client) is a loopback address, IPv4-mapped too."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _plain(host: str) -> tuple[int, bytes]:
    """The socket family and packed 16-byte address of `host` (IPv4-mapped addresses as IPv4: how the client's
    own socket holds them)."""
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    return family, address.packed.ljust(16, b"\0")


def peer_uid(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The uid owning the TCP socket at `client` connected to `server` (both as the scope reports them), or None
    when the kernel cannot say (no netlink here, or the connection is already gone)."""
    try:
        family, client_addr = _plain(client[0])
        server_family, server_addr = _plain(server[0])
    except ValueError:
        return None
    if family != server_family:
        return None
    sockid = (struct.pack(">HH", client[1], server[1]) + client_addr + server_addr
              + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE))
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES) + sockid
    message = _HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + request
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as s:
            s.settimeout(1.0)
            s.sendto(message, (0, 0))
            answer = s.recv(8192)
    except (OSError, AttributeError):  # AttributeError: a platform without AF_NETLINK
        return None
    if len(answer) < _UID_OFFSET + 4 or _HEADER.unpack_from(answer)[1] == _NLMSG_ERROR:
        return None
    uid: int = struct.unpack_from("=I", answer, _UID_OFFSET)[0]
    return uid


def trusted_uids() -> frozenset[int]:
    """The users whose local requests need no token: the server's own, and root (who may read its store anyway)."""
    return frozenset({os.geteuid(), 0})
