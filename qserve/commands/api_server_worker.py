"""One API server process of ``qserve serve --api-server-count N`` (``python -m
qserve.commands.api_server_worker INDEX``, started by ``qserve.commands.multi_api_server``).

Knows: what it is handed (a pickled ``WorkerLaunch`` on its stdin: the parsed arguments, the host
plan, the app's options, its two sockets to the engine core, the port, and the numbers of the
descriptors it inherits: the listening socket where the parent shares one, the read end of the
core's liveness pipe, the write end of its own), how it listens (the shared socket, or one of its
own in the port's ``SO_REUSEPORT`` group, bound before the models load), how it serves
(``serve_host.serve_app`` on that socket, attached to the running core through
``EngineCoreClient.connect``), and its exit status (0: drained; 1: the core died, or its socket
could not be bound; 2: the models did not load, said on stderr by API server 0 only). Must not
know: how the processes are started, watched or stopped (the parent).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import socket
import sys
from dataclasses import dataclass

from qserve.commands.serve_host import HostPlan, host_factory, serve_app
from qserve.engine.core.core import ClientAddresses


@dataclass(frozen=True)
class WorkerLaunch:
    """Everything one API server process needs (pickled to its stdin)."""

    index: int
    args: argparse.Namespace
    plan: HostPlan
    options: dict  # create_app's keyword arguments
    addresses: ClientAddresses  # its sockets to the engine core
    listen_fd: int | None  # the listening socket bound once by the parent; None: bind its own (SO_REUSEPORT)
    listen_port: int  # the port (--port, or the one the kernel chose for --port 0)
    core_alive_fd: int  # read end of the core's liveness pipe (EOF: the core is gone)
    alive_fd: int  # write end of its own (held until it exits: then the core aborts its requests)
    shutdown_timeout: float  # its share of --shutdown-timeout (the parent keeps a reserve for the core)
    log_level: int


def main() -> int:
    launch: WorkerLaunch = pickle.load(sys.stdin.buffer)
    logging.basicConfig(
        level=launch.log_level, format=f"%(levelname)s %(name)s (api server {launch.index}): %(message)s"
    )
    for fd in (launch.listen_fd, launch.core_alive_fd, launch.alive_fd):
        if fd is not None:
            os.set_inheritable(fd, False)  # a child of this process must not keep them open
    try:
        sock = _listening_socket(launch)
    except ValueError as err:
        print(f"qserve serve: error: API server {launch.index}: {err}", file=sys.stderr, flush=True)
        return 1  # not LOAD_FAILED: the parent stops the run, as for any API server that exits unasked

    def connect() -> object:
        from qserve.engine.core.client import EngineCoreClient

        return EngineCoreClient.connect(launch.addresses, core_alive_fd=launch.core_alive_fd, alive_fd=launch.alive_fd)

    factory = host_factory(launch.plan, connect=connect)
    try:
        return serve_app(
            launch.args,
            factory,
            sock,
            launch.options,
            api_server_index=launch.index,
            shutdown_timeout=launch.shutdown_timeout,
        )
    except (ValueError, FileNotFoundError) as err:
        if launch.index == 0:  # the others fail alike: one line says it
            print(f"qserve serve: error: {err}", file=sys.stderr, flush=True)
        return 2


def _listening_socket(launch: WorkerLaunch) -> socket.socket:
    """The parent's shared socket, or one of this process's own in the port's SO_REUSEPORT group
    (the parent holds the port meanwhile, so the bind fails only if the port changed hands)."""
    if launch.listen_fd is not None:
        return socket.socket(fileno=launch.listen_fd)
    from qserve.server.listen import bind_socket

    sock = bind_socket(launch.args.host, launch.listen_port, reuse_port=True)
    sock.set_inheritable(False)
    return sock


if __name__ == "__main__":
    sys.exit(main())
