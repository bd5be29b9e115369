"""One API server process of ``qserve serve --api-server-count N`` (``python -m
qserve.commands.api_server_worker INDEX``, started by ``qserve.commands.multi_api_server``).

Knows: what it is handed (a pickled ``WorkerLaunch`` on its stdin: the parsed arguments, the host
plan, the app's options, its two sockets to the engine core, and the numbers of the descriptors it
inherits: the listening socket, the read end of the core's liveness pipe, the write end of its
own), how it serves (``serve.serve_app`` on the inherited socket, attached to the running core
through ``EngineCoreClient.connect``), and its exit status (0: drained; 1: the core died; 2: the
models did not load, said on stderr by API server 0 only). Must not know: how the processes are
started, watched or stopped (the parent).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import socket
import sys
from dataclasses import dataclass

from qserve.commands.serve import HostPlan, host_factory, serve_app
from qserve.engine.core.core import ClientAddresses


@dataclass(frozen=True)
class WorkerLaunch:
    """Everything one API server process needs (pickled to its stdin)."""

    index: int
    args: argparse.Namespace
    plan: HostPlan
    options: dict  # create_app's keyword arguments
    addresses: ClientAddresses  # its sockets to the engine core
    listen_fd: int  # the listening socket, bound once by the parent
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
        os.set_inheritable(fd, False)  # a child of this process must not keep them open
    sock = socket.socket(fileno=launch.listen_fd)

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


if __name__ == "__main__":
    sys.exit(main())
