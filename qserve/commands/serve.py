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

    return ensure_demo_model()


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
    parser.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (or set ${API_KEY_ENV})")
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
        "--tenants",
        default=None,
        metavar="FILE.json",
        help="API keys -> tenants (weight, max_concurrent, max_queued, tokens_per_minute); see qserve/tenants.py",
    )
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
    for name, path in pairs:
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(
                f"model {name!r}: {path} has no config.json (is it a Hugging Face model directory?)"
            )
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


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from qserve.server.app import create_app

    factory = build_host_factory(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_failed(err: BaseException) -> None:
        failed.append(err)
        if server is not None:
            server.should_exit = True

    tenants = None
    if getattr(args, "tenants", None):
        from qserve.tenants import Tenants, load_tenants

        tenants = Tenants(load_tenants(args.tenants))
    app = create_app(host_factory=factory, api_key=api_key, on_load_failed=on_load_failed, tenants=tenants)
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
        raise ValueError(f"loading the models failed: {failed[0]}")
    return 0
