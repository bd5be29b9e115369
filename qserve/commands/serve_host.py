"""What runs a planned host (``HostPlan``, from ``qserve serve``'s arguments): the function that loads
the models (in this process, in an engine-core process of their own, or attached to one another
process started) and uvicorn serving the app over them until SIGTERM or a dead engine core.

Knows: ``HostPlan``'s fields, which builder each asks for, the app's start-up hooks (the ready line,
the frozen start-up heap, a dead core's exit code) and the drain on shutdown. Must not know: the
command line (``qserve.commands.serve`` turns it into a ``HostPlan``), routes, engines' internals.
Shared by ``qserve serve`` and the API server processes of ``--api-server-count N``
(``multi_api_server``, ``api_server_worker``), which import it rather than the command.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from qserve.commands.lora_flags import lora_module_requests, register_lora_modules

GRACEFUL_SHUTDOWN_S = 10


@dataclass(frozen=True)
class HostPlan:
    """What ``qserve serve``'s arguments say to host, validated; picklable, so an API server
    process of ``--api-server-count N`` gets it whole instead of checking the arguments again."""

    specs: list  # [ModelSpec]
    config: object  # HostConfig
    max_queue: int | None
    kv_events_config: object | None  # KVEventsConfig
    port: int
    separate_core: bool  # the engine core in its own process
    tensor_parallel_size: int
    lora_modules: list
    generation_config: str
    chat_template: str | None
    api_server_count: int = 1


def plan_lora_requests(plan: HostPlan) -> list:
    """``--lora-modules`` as the ``LoRARequest``s an engine core in its own process loads at start-up."""
    return lora_module_requests(plan.lora_modules, [spec.name for spec in plan.specs])


def host_factory(plan: HostPlan, connect: Callable[[], object] | None = None) -> Callable[[], object]:
    """The function that loads the models (slow; run after the server is up). ``connect``: an API
    server process of several attaches to the engine core ``qserve serve`` started instead."""
    from qserve.engine.async_engine import AsyncEngine, build_engines, build_tensor_parallel_engine

    specs, config = plan.specs, plan.config

    def kv_events(engines: dict) -> object | None:
        if plan.kv_events_config is None:
            return None
        from qserve.engine.kv_events import ZmqKVEventPublisher

        device = next(iter(engines.values())).device
        medium = "GPU" if device.type == "cuda" else "CPU"
        return ZmqKVEventPublisher(plan.kv_events_config, port=plan.port, medium=medium)  # type: ignore[arg-type]

    def build() -> AsyncEngine:
        if connect is not None:
            return connect()  # type: ignore[return-value]
        if plan.separate_core:  # the engine core in a process of its own (issue 27), shaped like AsyncEngine
            from qserve.engine.core.client import EngineCoreClient

            return EngineCoreClient.launch(  # type: ignore[return-value]
                specs,
                config,
                max_queue=plan.max_queue,
                kv_events=plan.kv_events_config,
                port=plan.port,
                lora_modules=plan_lora_requests(plan),
            )
        if plan.tensor_parallel_size == 1:
            engines = build_engines(specs, config)  # type: ignore[arg-type]
            return AsyncEngine(engines, max_queue=plan.max_queue, kv_events=kv_events(engines))
        engines, hooks = build_tensor_parallel_engine(specs[0], config, plan.tensor_parallel_size)  # type: ignore[arg-type]
        try:
            return AsyncEngine(engines, max_queue=plan.max_queue, hooks=hooks, kv_events=kv_events(engines))
        except BaseException:
            if hooks.shutdown is not None:
                hooks.shutdown()  # nobody else holds the workers yet
            raise

    def factory() -> AsyncEngine:
        from qserve.server.generation_config import load_sampling_defaults

        host = build()
        register_lora_modules(host, plan.lora_modules)
        for spec in specs:  # worker flags that shape the front end, per model
            hosted = host.models[spec.name]
            hosted.sampling_defaults = load_sampling_defaults(plan.generation_config, spec.path)
            if plan.chat_template is not None:
                hosted.engine.tokenizer.chat_template = plan.chat_template  # the front end copies it
        return host

    return factory


def ready_line(url: str, host: object, block_size: int) -> str:
    """The line printed once every model is loaded: where to send requests, which models, and
    how much KV cache the pool holds (every model draws pages from the one pool)."""
    stats = host.stats()  # type: ignore[attr-defined]
    names = ", ".join(stats)
    pages = max((s["pool_pages_total"] for s in stats.values()), default=0)
    return (
        f"qserve: ready on {url} (OpenAI API at {url}/v1) - models: {names}; "
        f"KV cache: {pages:,} pages x {block_size} tokens = {pages * block_size:,} tokens"
    )


def serve_app(
    args: argparse.Namespace,
    factory: Callable[[], object],
    sock: object | None,
    options: dict,
    *,
    api_server_index: int | None = None,
    shutdown_timeout: float | None = None,
) -> int:
    """Run the app under uvicorn until SIGTERM (0) or a dead engine core (1); ValueError when the
    models do not load. ``sock``: the listening socket (None: bind ``--host``/``--port`` here).
    ``api_server_index``: one API server of several (only the first prints the ready line; the
    parent says where it serves and reports a dead core)."""
    import uvicorn

    from qserve.engine.core.startup_heap import freeze_startup_heap
    from qserve.server.app import create_app
    from qserve.server.draining_server import DrainingServer

    failed: list[BaseException] = []
    core_died: list[str] = []
    server: uvicorn.Server | None = None
    first = api_server_index in (None, 0)

    def on_load_failed(err: BaseException) -> None:
        failed.append(err)
        if server is not None:
            server.should_exit = True

    def on_core_died(reason: str) -> None:  # the loop thread; streams in flight have their error event
        core_died.append(reason)
        if server is not None:
            server.should_exit = True  # exit non-zero: the supervisor restarts the server

    def on_ready(host: object) -> None:
        if hasattr(host, "on_dead"):  # the engine core in its own process
            host.on_dead.append(on_core_died)
        if first:
            print(ready_line(f"http://{args.host}:{args.port}", host, args.block_size), flush=True)
        # the server's objects out of the collector's walks: a full collection stalls every stream
        freeze_startup_heap()

    app = create_app(
        host_factory=factory,  # type: ignore[arg-type]
        on_load_failed=on_load_failed,
        on_ready=on_ready,
        api_server_index=api_server_index,
        **options,
    )
    show_worker_logs(args)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        root_path=getattr(args, "root_path", None) or "",
    )
    timeout = args.shutdown_timeout if shutdown_timeout is None else shutdown_timeout
    server = DrainingServer(config, app, timeout)
    if sock is None:
        from qserve.server.listen import bind_socket

        sock = bind_socket(args.host, args.port)  # a taken port: one line, and no "serving on" before it
        print(f"qserve: serving on http://{args.host}:{args.port} (models load in the background; see /health)")
    server.run(sockets=[sock])
    if failed:
        raise ValueError(f"loading the models failed: {failed[0]}") from failed[0]  # --debug: its traceback
    if core_died:
        if api_server_index is None:
            print(f"qserve serve: error: {core_died[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


# ---------------------------------------------------------------------- shutdown drain and worker logs
# Loggers whose INFO lines a worker prints even at the default level (as vLLM does): the per-request
# and stats lines, and the drain's progress. An explicit --log-level decides for them too.
WORKER_LOGGERS = ("qserve.server.request_log", "qserve.server.drain")


def show_worker_logs(args: argparse.Namespace) -> None:
    if getattr(args, "log_level", None) is None:
        for name in WORKER_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO)
