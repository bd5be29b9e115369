"""``qserve serve --api-server-count N`` (N > 1): one engine-core process and N API server processes
on one port; each has its own ZMQ connection to the core, which routes each request's outputs back
to the API server that sent it. On Linux each API server listens on a ``SO_REUSEPORT`` socket of its
own, and the kernel hashes each new connection to one of them; elsewhere (vLLM's layout) the parent
binds one socket and hands it to every API server, and whichever process wakes first accepts. On a
2-core machine the shared socket gave one of 2 API servers 65-83% of 200 sequential one-token
completions (27-71% of 200 ``/health`` calls, sequential or 16 at a time); the sockets of their own
gave each 48-52% (44-56% for ``/health``). The parent checks the port without ``SO_REUSEPORT`` (a
taken port, by another qserve too, is one line and nothing starts), then holds it with a socket of
the group, bound but never listening, until the run ends.

Knows: the run's private directory (the ``ipc://`` sockets; the metrics files of prometheus_client's
multiprocess mode, unless ``PROMETHEUS_MULTIPROC_DIR`` is already set; the Responses store the API
servers share), made here and removed at exit; the liveness pipes (the core holds the write end of
its own, which every API server watches; each API server holds the write end of one the core
watches: EOF says a process is gone, whatever killed it); the start-up order (bind, core, API
servers, then close this process's copies of what the children hold, so only the holder keeps a
pipe open); and how the run ends. SIGTERM or SIGINT here is passed on, once, to every API server
(started in sessions of their own, so a terminal's Ctrl-C reaches them only this way), which drains
as one server does, within ``--shutdown-timeout`` less a reserve; each leaves the core as it exits,
and the core exits when the last has left; whatever still runs at the deadline is killed; exit 0.
An API server that exits unasked (killed, crashed) stops the run, as vLLM's launcher does: the core
has aborted its requests (pages freed), the others get SIGTERM and drain as above, and the run
exits 1, so the supervisor restarts every process rather than a pod serving on with fewer front
ends unnoticed. The core dying makes every API server answer 503 and exit; the run exits 1. Models
that do not load: API server 0 says why; exit 2. Must not know: routes, engines, how an API server
serves.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from types import FrameType

from qserve.commands.api_server_worker import WorkerLaunch
from qserve.commands.serve_host import GRACEFUL_SHUTDOWN_S, HostPlan, plan_lora_requests

logger = logging.getLogger(__name__)

PROMETHEUS_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
POLL_S = 0.05
CORE_STOP_RESERVE_S = 1.0  # of --shutdown-timeout, kept for the core's exit after the API servers'
CORE_EXIT_WAIT_S = 10.0  # the core's own exit, when no deadline runs
LOAD_FAILED = 2  # an API server's status when the models did not load


def run_api_servers(args: argparse.Namespace, plan: HostPlan, options: dict) -> int:
    """Serve with ``plan.api_server_count`` API server processes over one engine core; the exit
    status of the run (see the module doc)."""
    from qserve.engine.core.core import ClientAddresses, CoreConfig
    from qserve.engine.core.process import start_core_process
    from qserve.server.listen import bind_socket, reuse_port_balances

    count = plan.api_server_count
    sock = bind_socket(args.host, args.port)  # a taken port: one line, before anything starts
    port = sock.getsockname()[1]  # (--port 0: the one the kernel chose, for every API server)
    share_socket = not reuse_port_balances()
    if not share_socket:
        # Each API server listens on a SO_REUSEPORT socket of its own (the kernel hashes each new
        # connection to one: an even spread, where one shared socket gave most to one process).
        # The check above was made without the option, so a server already on the port (qserve
        # with SO_REUSEPORT too) is refused, not joined; this socket, bound but never listening,
        # then holds the port for the run, so the API servers' binds cannot lose it meanwhile.
        sock.close()
        sock = bind_socket(args.host, port, reuse_port=True)
    run_dir = tempfile.mkdtemp(prefix="qserve-run-")
    children: list[subprocess.Popen[bytes]] = []
    fds: list[int] = []
    try:
        metrics_dir = _metrics_dir(run_dir)
        core_read, core_write = os.pipe()
        pipes = [os.pipe() for _ in range(count)]  # (the core's read end, the API server's write end)
        fds += [core_read, core_write, *(fd for pipe in pipes for fd in pipe)]
        addresses = [
            ClientAddresses(f"ipc://{run_dir}/core-input-{i}", f"ipc://{run_dir}/core-output-{i}", pipes[i][0])
            for i in range(count)
        ]
        core = start_core_process(
            CoreConfig(
                models=plan.specs,
                host=plan.config,  # type: ignore[arg-type]
                clients=addresses,
                max_queue=plan.max_queue,
                log_level=logging.getLogger().getEffectiveLevel(),
                kv_events=plan.kv_events_config,  # type: ignore[arg-type]
                port=plan.port,
                alive_fd=core_write,
                lora_modules=plan_lora_requests(plan),
            ),
            pass_fds=[core_write, *(read for read, _ in pipes)],
        )
        children.append(core)
        from qserve.server.shared_response_store import SharedResponseStore  # noqa: PLC0415 - the server's deps

        responses_db = os.path.join(run_dir, "responses.sqlite3")
        SharedResponseStore.prepare(responses_db)  # the API servers open it at once: the WAL switch made here
        options = {**options, "metrics_dir": metrics_dir, "responses_db": responses_db}
        env = {**os.environ, PROMETHEUS_MULTIPROC_ENV: metrics_dir}
        reserve = min(CORE_STOP_RESERVE_S, 0.1 * args.shutdown_timeout)
        servers = []
        for i in range(count):
            launch = WorkerLaunch(
                index=i,
                args=_picklable(args),
                plan=plan,
                options=options,
                addresses=ClientAddresses(addresses[i].input_address, addresses[i].output_address),
                listen_fd=sock.fileno() if share_socket else None,
                listen_port=port,
                core_alive_fd=core_read,
                alive_fd=pipes[i][1],
                shutdown_timeout=args.shutdown_timeout - reserve,
                log_level=logging.getLogger().getEffectiveLevel(),
            )
            servers.append(_start_api_server(launch, env))
            children.append(servers[-1])
        # Only the children hold these now: a pipe's EOF is its holder's death.
        for fd in fds:
            os.close(fd)
        fds.clear()
        if share_socket:
            sock.close()
        print(
            f"qserve: serving on http://{args.host}:{args.port} with {count} API server processes "
            "(models load in the background; see /health)",
            flush=True,
        )
        return _supervise(core, servers, args.shutdown_timeout)
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()  # (SO_REUSEPORT: the port's holder, kept until every API server has exited)
        for child in children:  # only after an error here, or past a deadline
            if child.poll() is None:
                child.kill()
                child.wait()
        shutil.rmtree(run_dir, ignore_errors=True)  # sockets, metrics files, the Responses store


def _metrics_dir(run_dir: str) -> str:
    """Where the API servers' metrics files go: the run's own directory (removed at exit), or the
    one the environment names (vLLM's rule: then the operator wipes it between runs)."""
    given = os.environ.get(PROMETHEUS_MULTIPROC_ENV)
    if given:
        logger.warning(
            "$%s=%s is set: the API servers' metrics files go there; wipe it between runs, or /metrics sums "
            "the counters of earlier runs too (unset it and qserve uses a directory of its own)",
            PROMETHEUS_MULTIPROC_ENV,
            given,
        )
        os.makedirs(given, exist_ok=True)
        return given
    path = os.path.join(run_dir, "metrics")
    os.mkdir(path)
    return path


def _picklable(args: argparse.Namespace) -> argparse.Namespace:
    values = {k: v for k, v in vars(args).items() if not callable(v)}  # the sub-command's function
    return argparse.Namespace(**values)


def _start_api_server(launch: WorkerLaunch, env: dict[str, str]) -> subprocess.Popen[bytes]:
    fds = tuple(fd for fd in (launch.listen_fd, launch.core_alive_fd, launch.alive_fd) if fd is not None)
    process = subprocess.Popen(
        [sys.executable, "-m", "qserve.commands.api_server_worker", str(launch.index)],
        stdin=subprocess.PIPE,
        env=env,
        pass_fds=fds,
        start_new_session=True,  # a terminal's Ctrl-C reaches the parent, which passes it on once
    )
    assert process.stdin is not None
    process.stdin.write(pickle.dumps(launch))
    process.stdin.close()
    return process


def _supervise(core: subprocess.Popen[bytes], servers: list[subprocess.Popen[bytes]], shutdown_timeout: float) -> int:
    """Wait for the run to end; pass signals on; the run's exit status."""
    deadline: list[float] = []  # set by the first signal

    def on_signal(sig: int, frame: FrameType | None) -> None:
        if not deadline:
            deadline.append(time.monotonic() + shutdown_timeout)
        for server in servers:  # a second signal cuts their drain short, a third forces them: as one server
            if server.poll() is None:
                server.send_signal(sig)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _wait(core, servers, deadline, shutdown_timeout)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait(
    core: subprocess.Popen[bytes],
    servers: list[subprocess.Popen[bytes]],
    deadline: list[float],
    shutdown_timeout: float,
) -> int:
    reported: set[int] = set()
    core_died_at: float | None = None
    lost: str | None = None  # an API server that exited unasked: the run stops (vLLM's rule)
    while True:
        now = time.monotonic()
        # The core first: API servers that exit because it died are not lost on their own.
        # (It exits 0 only once every API server has left it; they may still be exiting.)
        if core_died_at is None and core.poll() is not None and core.returncode != 0:
            core_died_at = now  # every API server notices it and exits
        live = [s for s in servers if s.poll() is None]
        for i, server in enumerate(servers):
            if server.returncode is not None and i not in reported:
                reported.add(i)
                if deadline or core_died_at is not None or server.returncode == LOAD_FAILED:
                    continue  # asked to stop, the core's death, or a load error every API server has
                lost = f"API server {i} (pid {server.pid}) exited with status {server.returncode}"
                # Serving on with fewer front ends would hide the fault from the supervisor (and
                # shrink the pod's capacity for good): stop every process, as vLLM's launcher does,
                # draining the others as SIGTERM would, and exit 1 so the whole run is restarted.
                logger.error(
                    "%s; the engine core aborted its requests; stopping the %d other API server(s) within "
                    "--shutdown-timeout (%.0f s) so that the run exits 1 and its supervisor restarts it",
                    lost,
                    len(live),
                    shutdown_timeout,
                )
                deadline.append(now + shutdown_timeout)
                for other in live:
                    other.send_signal(signal.SIGTERM)
        if not live:
            break
        limit = deadline[0] if deadline else None
        if core_died_at is not None:
            limit = min(limit or float("inf"), core_died_at + GRACEFUL_SHUTDOWN_S + 5.0)
        if limit is not None and now >= limit:
            logger.warning("%d API server(s) still running at the deadline: killing them", len(live))
            for server in live:
                server.kill()
                server.wait()
            break
        time.sleep(POLL_S)
    # Every API server has left: the core exits by itself (at once; it was told by the pipes).
    wait_s = max(deadline[0] - time.monotonic(), 0.0) if deadline else CORE_EXIT_WAIT_S
    try:
        core.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        logger.warning("the engine core did not exit after the API servers; killing it")
        core.kill()
        core.wait()
    codes = [s.returncode for s in servers]
    if core_died_at is not None:
        if all(code == LOAD_FAILED for code in codes):
            return LOAD_FAILED  # API server 0 said why
        print(
            f"qserve serve: error: the engine core process died (exit code {core.returncode}); "
            "every API server stopped",
            file=sys.stderr,
            flush=True,
        )
        return 1
    if lost is not None:
        print(f"qserve serve: error: {lost}; every process stopped", file=sys.stderr, flush=True)
        return 1
    if deadline:
        return 0  # drained
    if all(code == LOAD_FAILED for code in codes):
        return LOAD_FAILED
    print(f"qserve serve: error: every API server process exited (statuses {codes})", file=sys.stderr, flush=True)
    return 1
