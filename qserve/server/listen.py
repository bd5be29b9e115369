"""The listening socket of ``qserve serve``, bound before anything says the server is up.

Knows: how to bind a TCP socket for a host and port the way uvicorn does (IPv6 for a host with
a colon, ``SO_REUSEADDR``, inheritable for workers), and how to say in one line why a port cannot
be had; and whether this platform balances connections over sockets bound with ``SO_REUSEPORT``
(Linux hashes each new connection to one of the group's listening sockets; other kernels accept
the option but do not spread connections by it). Must not know: the app, uvicorn's server loop (it
is handed the bound socket), how many processes listen.
"""

from __future__ import annotations

import errno
import socket
import sys


def reuse_port_balances() -> bool:
    """True where several processes can each listen on their own ``SO_REUSEPORT`` socket on one
    port and the kernel spreads new connections over them (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A socket bound to ``host:port`` (listening starts when the server takes it); ValueError
    naming the port when it is taken or not allowed. ``reuse_port``: join the port's
    ``SO_REUSEPORT`` group (other such sockets of this user may bind it too; without it, any
    socket bound there already makes this one fail)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            reason = f"port {port} is already in use (another server?); pick a free one with --port"
        elif err.errno == errno.EACCES:
            reason = f"port {port} needs privileges on this machine; pick one above 1023 with --port"
        else:
            reason = f"{err.strerror or err} (--host {host}, --port {port})"
        raise ValueError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock
