"""Serve one or more models over an OpenAI-compatible HTTP API (``qserve serve MODEL [MODEL ...]``).

Knows: the ``qserve serve`` arguments (models as ``path`` or ``name=path``, budget, shares,
queue bound, API key, tensor-parallel size), how they become ``ModelSpec`` / ``HostConfig``,
which builder they pick (several models on one shared page pool, or one model sharded over
``--tensor-parallel-size`` processes), and how to run uvicorn with the app (models load in the
background; ``/health`` is 503 until they are ready; SIGTERM / Ctrl-C shut down gracefully,
tensor-parallel workers included). Must not know: routes, engines' internals.

With no model argument it serves the built-in demo model (``DEFAULT_MODEL``): a tiny model
trained by ``recipes/demo/train.py``, quantized with qserve's own GPTQ on first use and cached.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def _demo_model() -> str:
    from qserve.quantize.demo import ensure_demo_model

    return ensure_demo_model(report=lambda message: print(f"qserve: {message}", flush=True))


# A callable returning the path of the model served when none is given.
DEFAULT_MODEL: Callable[[], str] | None = _demo_model
API_KEY_ENV = "QSERVE_API_KEY"
GRACEFUL_SHUTDOWN_S = 10


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help="a model directory, or NAME=PATH to serve it under NAME (default name: the directory's name)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (visible in the process list: prefer ${API_KEY_ENV} or --api-key-file)",
    )
    parser.add_argument(
        "--gpu-memory-budget",
        default=None,
        help="memory qserve may use: bytes (24GiB, 512MiB) or a fraction of the device (0.9); on CPU it caps the KV pool",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="KV cache element type: auto (the model dtype), fp8 (e4m3) or int8"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="do not capture CUDA graphs for decode")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once, per model")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--max-queue", type=int, default=None, help="refuse requests (429) while this many wait, per model"
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None, help="pages in the shared KV pool (overrides the budget)"
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the one served model over this many processes, one per GPU (cuda:0..N-1; "
        "gloo processes on CPU); CUDA graphs are not captured above 1",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--min-share",
        action="append",
        default=[],
        metavar="NAME=FRACTION",
        help="pages of the pool reserved for model NAME (fraction of the pool); repeatable",
    )
    parser.add_argument(
        "--max-share",
        action="append",
        default=[],
        metavar="NAME=FRACTION",
        help="most pages of the pool model NAME may hold (fraction of the pool); repeatable",
    )
    _register_hardening(parser)


# ---------------------------------------------------------------------- access and limits (hardening)
def _register_hardening(parser: argparse.ArgumentParser) -> None:
    from qserve.server.guard import DEFAULT_MAX_REQUEST_BYTES

    parser.add_argument(
        "--api-key-file", default=None, metavar="PATH", help="read the API key from this file (first line)"
    )
    parser.add_argument(
        "--allowed-hosts",
        action="append",
        default=[],
        metavar="HOST[,HOST...]",
        help="Host header values accepted (default: the bind host, localhost, 127.0.0.1, ::1; any host when "
        "bound to 0.0.0.0); '*' accepts any; repeatable",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="refuse request bodies larger than this (413) before reading them; 0: no limit",
    )
    parser.add_argument("--metrics-without-key", action="store_true", help="serve /metrics without the API key")


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, $QSERVE_API_KEY or --api-key (warned: the process list shows it)."""
    given = [name for name, value in (("--api-key", args.api_key), ("--api-key-file", args.api_key_file)) if value]
    if len(given) > 1:
        raise ValueError("give the API key once: --api-key or --api-key-file")
    if args.api_key_file:
        path = Path(args.api_key_file)
        try:
            lines = path.read_text().strip().splitlines()
        except OSError as err:
            raise ValueError(f"--api-key-file {path}: cannot read it ({err.strerror})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api-key-file {path}: the file is empty")
        return key
    if args.api_key:
        logger.warning(
            "--api-key is visible to every user of this machine in the process list; use $%s or --api-key-file",
            API_KEY_ENV,
        )
        return args.api_key
    return os.environ.get(API_KEY_ENV) or None


def resolve_allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    from qserve.server.guard import default_allowed_hosts

    hosts = [h.strip() for value in args.allowed_hosts for h in value.split(",") if h.strip()]
    if not hosts:
        hosts_or_none = default_allowed_hosts(args.host)
        if hosts_or_none is None:
            logger.warning("bound to %s: any Host header is accepted; pass --allowed-hosts to restrict it", args.host)
        return hosts_or_none
    return None if "*" in hosts else hosts


def parse_model_args(values: list[str]) -> list[tuple[str, str]]:
    """``["a=/m/x", "/m/y"]`` -> ``[("a", "/m/x"), ("y", "/m/y")]``."""
    result = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            path = value
            name = Path(value.rstrip("/")).name or value
        if not name or not path:
            raise ValueError(f"model {value!r}: use PATH or NAME=PATH")
        result.append((name, path))
    return result


def parse_shares(values: list[str], flag: str, names: list[str]) -> dict[str, float]:
    shares: dict[str, float] = {}
    for value in values:
        name, sep, fraction = value.partition("=")
        if not sep:
            raise ValueError(f"{flag} {value!r}: use NAME=FRACTION, e.g. {flag} {names[0]}=0.5")
        if name not in names:
            raise ValueError(f"{flag} {value!r}: no model named {name!r}; models: {', '.join(names)}")
        try:
            shares[name] = float(fraction)
        except ValueError:
            raise ValueError(f"{flag} {value!r}: {fraction!r} is not a number") from None
        if not 0.0 <= shares[name] <= 1.0:
            raise ValueError(f"{flag} {value!r}: a share is a fraction of the pool in [0, 1]")
    return shares


def build_host_factory(args: argparse.Namespace) -> Callable[[], object]:
    """Validate the arguments now (cheap errors before the server starts) and return the
    function that loads the models (slow; run after the server is up)."""
    from qserve.engine.async_engine import (
        SUPPORTED_KV_CACHE_DTYPES,
        AsyncEngine,
        HostConfig,
        ModelSpec,
        build_engines,
        build_tensor_parallel_engine,
    )
    from qserve.memory.planner import parse_memory_budget

    values = list(args.models)
    if not values and DEFAULT_MODEL is not None:
        values = [DEFAULT_MODEL()]
    if not values:
        raise ValueError("no model given: qserve serve MODEL [MODEL ...] (a model directory or NAME=PATH)")
    if args.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype {args.kv_cache_dtype!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}"
        )
    if args.gpu_memory_budget is not None:
        parse_memory_budget(args.gpu_memory_budget, device_total_bytes=1)  # syntax check only
    tensor_parallel_size = getattr(args, "tensor_parallel_size", 1)
    if tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    pairs = parse_model_args(values)
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be unique, got {names}; use NAME=PATH")
    if tensor_parallel_size > 1:
        # Several models share one page pool in this process; a sharded model has a pool of its
        # own on every device, so it is served alone (as vLLM serves one model per server).
        if len(pairs) != 1:
            raise ValueError(
                f"--tensor-parallel-size {tensor_parallel_size} serves one model; got {len(pairs)} models "
                f"({', '.join(names)})"
            )
        if args.min_share or args.max_share:
            raise ValueError(
                f"--min-share / --max-share divide a pool shared by several models; with "
                f"--tensor-parallel-size {tensor_parallel_size} the one model has its own pool"
            )
    from qserve.model.checkpoint_check import check_checkpoint

    for name, path in pairs:
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(
                f"model {name!r}: {path} has no config.json (is it a Hugging Face model directory?)"
            )
        # The checks inspect runs (config, format, tensor headers, tokenizer), before the server
        # starts: a broken checkpoint is one line on stderr, not a traceback from the loader thread.
        try:
            check_checkpoint(path)
        except (ValueError, FileNotFoundError) as err:
            raise type(err)(f"model {name!r}: {err}") from err
    min_shares = parse_shares(args.min_share, "--min-share", names)
    max_shares = parse_shares(args.max_share, "--max-share", names)
    specs = [ModelSpec(name, path, min_shares.get(name), max_shares.get(name)) for name, path in pairs]
    config = HostConfig(
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_budget=args.gpu_memory_budget,
        num_kv_blocks=args.num_kv_blocks,
        enforce_eager=args.enforce_eager,
    )

    def factory() -> AsyncEngine:
        if tensor_parallel_size == 1:
            return AsyncEngine(build_engines(specs, config), max_queue=args.max_queue)
        engines, hooks = build_tensor_parallel_engine(specs[0], config, tensor_parallel_size)
        try:
            return AsyncEngine(engines, max_queue=args.max_queue, hooks=hooks)
        except BaseException:
            if hooks.shutdown is not None:
                hooks.shutdown()  # nobody else holds the workers yet
            raise

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


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from qserve.server.app import create_app

    factory = build_host_factory(args)
    api_key = resolve_api_key(args)
    if args.max_request_bytes < 0:
        raise ValueError(f"--max-request-bytes must be >= 0, got {args.max_request_bytes}")
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_failed(err: BaseException) -> None:
        failed.append(err)
        if server is not None:
            server.should_exit = True

    def on_ready(host: object) -> None:
        print(ready_line(f"http://{args.host}:{args.port}", host, args.block_size), flush=True)

    app = create_app(
        host_factory=factory,
        api_key=api_key,
        on_load_failed=on_load_failed,
        allowed_hosts=resolve_allowed_hosts(args),
        max_request_bytes=args.max_request_bytes or None,
        metrics_without_key=args.metrics_without_key,
        on_ready=on_ready,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    print(f"qserve: serving on http://{args.host}:{args.port} (models load in the background; see /health)")
    server.run()
    if failed:
        raise ValueError(f"loading the models failed: {failed[0]}") from failed[0]  # --debug: its traceback
    return 0
