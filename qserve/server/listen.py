"""The listening socket of ``qserve serve``, bound before anything says the server is up.

Knows: how to bind a TCP socket for a host and port the way uvicorn does (IPv6 for a host with
a colon, ``SO_REUSEADDR``, inheritable for workers), and how to say in one line why a port cannot
be had. Must not know: the app, uvicorn's server loop (it is handed the bound socket).
"""

from __future__ import annotations

import errno
import socket


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (listening starts when the server takes it); ValueError
    naming the port when it is taken or not allowed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
