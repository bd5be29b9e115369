"""Starting the engine-core process (``python -m qserve.engine.core.core``).

Knows: how the core is started (its ``CoreConfig`` pickled to its stdin; the file descriptors it
must inherit, its liveness pipes, passed by number) and the environment it gets (on CPU, OpenMP
threads that sleep when idle). Used by ``EngineCoreClient.launch`` (one front end, the core its
child) and by ``qserve serve --api-server-count N`` (the core a sibling of the front ends). Must
not know: sockets, messages, HTTP.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Sequence

from qserve.engine.async_engine import HostConfig
from qserve.engine.core.core import CoreConfig


def start_core_process(config: CoreConfig, pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
    """Start the core with ``config``; it loads the models and then says ``Ready`` to each front end.
    ``pass_fds``: descriptors the core inherits (the numbers ``config`` names)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "qserve.engine.core.core"],
        stdin=subprocess.PIPE,
        env=core_environment(config.host),
        pass_fds=tuple(pass_fds),
    )
    try:
        assert process.stdin is not None
        process.stdin.write(pickle.dumps(config))
        process.stdin.close()
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


def core_environment(config: HostConfig) -> dict[str, str]:
    """The core's environment: this one, plus, on CPU, OpenMP threads that sleep when idle
    (``OMP_WAIT_POLICY=PASSIVE``, unless set). Why: the front end works between the core's
    steps; with OpenMP's default spinning, a step's threads waited for a CPU the spinning took
    (2-core machine, tiny model: 20-75 ms per token instead of 2-4 ms; passive: 4 ms, in-process 3)."""
    from qserve.engine.engine import resolve_device

    env = dict(os.environ)
    if resolve_device(config.device).type == "cpu":
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env
