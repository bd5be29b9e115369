"""Serve one or more models over an OpenAI-compatible HTTP API (``qserve serve MODEL [MODEL ...]``).

Knows: the ``qserve serve`` arguments (models as ``path`` or ``name=path``, budget, shares,
queue bound, API key, tensor-parallel size), how they become ``ModelSpec`` / ``HostConfig``,
which builder they pick (several models on one shared page pool, or one model sharded over
``--tensor-parallel-size`` processes), all of it validated into a ``HostPlan`` that
``qserve.commands.serve_host`` runs (uvicorn with the app; models load in the background; ``/health``
is 503 until they are ready; SIGTERM drains for ``--shutdown-timeout`` seconds, then shuts down,
tensor-parallel workers included), and vLLM's flag names (resolved onto qserve's own options by
``apply_worker_flags``). On CUDA (``core_process_by_default``), or with
``$QSERVE_ENABLE_MULTIPROCESSING=1``, the models load in an engine-core process of their own
(``qserve.engine.core``; what that mode does not support yet is refused here when asked for by name,
and served in one process by default), and the server exits 1 if that process dies. ``--api-server-count N``
above 1 implies it and runs N API server processes over that core (``multi_api_server``; each one
runs ``serve_host.serve_app`` as the one server does). Must not know: routes, engines' internals.

With no model argument it serves the built-in demo model (``DEFAULT_MODEL``): a tiny model
trained by ``qserve/recipes/demo/train.py``, quantized with qserve's own GPTQ on first use and cached.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path

from qserve.commands.lora_flags import check_lora_flags, register_lora_flags
from qserve.commands.serve_host import HostPlan, host_factory, serve_app
from qserve.commands.vllm_flags import (
    add_speculative_config_argument,
    check_quantization,
    cors_config,
    register_vllm_flags,
)
from qserve.model.hub import add_revision_argument, is_hub_id, resolve_model_path
from qserve.scheduler.swap import PREEMPTION_MODES, check_tensor_parallel_preemption  # pure Python, no torch
from qserve.spec_decode.config import parse_speculative_config  # pure Python, no torch

logger = logging.getLogger(__name__)

# Tokens per step when serving, unless --max-num-batched-tokens says otherwise (the offline ``LLM`` keeps
# the engine's 2,048, as vLLM gives its server a smaller budget than its ``LLM``): a decode waits behind
# a step's prompt tokens, and on the H100 (bench/RESULTS.md, seventh session) 1,024 brought ITL p99 at
# Poisson 16 req/s from 76 to 59 ms with out tok/s equal (2,633 vs 2,618) and TTFT p99 halved.
SERVE_MAX_NUM_BATCHED_TOKENS = 1024

# qserve.server.tools.PARSERS (not imported here: the CLI starts without the server's imports)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3")


def _demo_model() -> str:
    from qserve.quantize.demo import ensure_demo_model

    return ensure_demo_model(report=lambda message: print(f"qserve: {message}", flush=True))


# A callable returning the path of the model served when none is given.
DEFAULT_MODEL: Callable[[], str] | None = _demo_model
API_KEY_ENV = "QSERVE_API_KEY"


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help="a model directory, a Hugging Face Hub id in the local cache (org/name; served under the id), "
        "or NAME=PATH to serve it under NAME (default name: the directory's name)",
    )
    add_revision_argument(parser)
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
        "--kv-cache-dtype",
        default="auto",
        help="KV cache element type: auto (the model dtype), fp8 (e4m3), int8 or int4",
    )
    parser.add_argument("--enforce-eager", action="store_true", help="do not capture CUDA graphs for decode")
    # -- async scheduling (issue 17) --
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule and launch the next step while the current one runs on the device (default: on; "
        "--no-async-scheduling for the synchronous order; docs/async_scheduling.md)",
    )
    # -- swap preemption (issue 17) --
    parser.add_argument(
        "--preemption-mode",
        choices=PREEMPTION_MODES,
        default="recompute",
        help="when KV pages run out: recompute the preempted sequence later (default), swap its KV to pinned "
        "host memory and back, or auto (swap where the estimated copy time is below the recompute time)",
    )
    parser.add_argument(
        "--swap-space",
        type=float,
        default=4.0,
        help="GiB of host memory for swapped KV, split between the served models (default 4; used only "
        "with --preemption-mode swap or auto)",
    )
    add_speculative_config_argument(parser)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once, per model")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"tokens per step, per model (default {SERVE_MAX_NUM_BATCHED_TOKENS}, or the block size if larger): "
        "smaller bounds how long a decode waits behind prompt tokens, larger prefills in fewer steps",
    )
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
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="a mixture-of-experts model's routed experts: whole experts per rank (contiguous blocks) instead of "
        "a slice of every expert (vLLM's flag; attention and dense layers stay tensor-parallel)",
    )
    parser.add_argument("--seed", type=int, default=0)
    # ---- playground and tool calling (issue 18)
    parser.add_argument("--no-ui", action="store_true", help="do not serve the playground page at /")
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="format of tool calls in model output (default: from each model's chat template)",
    )
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
    _register_hardening(parser)
    register_lora_flags(parser)
    register_worker_flags(parser)
    register_vllm_flags(parser)


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


# ---------------------------------------------------------------------- vLLM-compatible worker flags
# The names Helm charts and launch scripts pass to `vllm serve`, plus the shutdown drain and
# the log switches. Resolved onto qserve's own options by apply_worker_flags().
KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8"}
DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0  # inside Kubernetes' default 30 s termination grace period


def register_worker_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM-compatible worker options")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the name(s) the model(s) are served under, one per MODEL, in order (as NAME=PATH does)",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of the device qserve may use (vLLM's name; same as --gpu-memory-budget FRACTION)",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse KV pages of shared prompt prefixes (default: on)",
    )
    group.add_argument(
        "-tp", dest="tensor_parallel_size", type=int, default=argparse.SUPPRESS, help="--tensor-parallel-size"
    )
    group.add_argument(
        "--chat-template", default=None, help="a Jinja chat template (file path or the template itself) for every model"
    )
    group.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for fields a request leaves out: 'auto' (each model's generation_config.json), "
        "'vllm' (none) or a directory holding a generation_config.json",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM: refuse new requests (503), let in-flight ones finish for up to this many seconds, "
        "then end the rest with finish_reason 'abort' and exit",
    )
    group.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server (front-end) processes sharing the port; above 1 the engine core runs in a process of "
        "its own under them, as on CUDA by default (docs/server.md); default 1",
    )
    group.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    group.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line while busy")
    group.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's own log level (default: follows --log-level)",
    )
    group.add_argument(
        "--log-level", default=argparse.SUPPRESS, help="logging level (also accepted before the sub-command)"
    )
    group.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish KV-cache events for prefix-aware routers (vLLM's format), e.g. '{\"enable_kv_cache_events\": "
        'true, "publisher": "zmq"}\'; endpoint default tcp://127.0.0.1:5557 (loopback: the events carry prompts\' '
        "token ids; another address is warned), topic default kv@{pod}:{port}@{model}",
    )


def apply_worker_flags(args: argparse.Namespace) -> None:
    """Resolve the vLLM-named flags onto qserve's own options (in place); ValueError on conflicts."""
    utilization = getattr(args, "gpu_memory_utilization", None)
    if utilization is not None:
        if args.gpu_memory_budget is not None:
            raise ValueError("give --gpu-memory-budget or --gpu-memory-utilization, not both")
        if not 0.0 < utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
        args.gpu_memory_budget = str(utilization)
    if getattr(args, "enable_prefix_caching", None) is not None:
        if args.no_prefix_caching and args.enable_prefix_caching:
            raise ValueError("--no-prefix-caching contradicts --enable-prefix-caching")
        args.no_prefix_caching = not args.enable_prefix_caching
    args.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(args.kv_cache_dtype, args.kv_cache_dtype)
    if getattr(args, "shutdown_timeout", 0.0) < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    source = getattr(args, "generation_config", "auto")
    if source not in ("auto", "vllm") and not Path(source).is_dir():
        raise FileNotFoundError(f"--generation-config {source}: not 'auto', 'vllm' or a directory")


def apply_served_model_names(pairs: list[tuple[str, str]], names: list[str] | None) -> list[tuple[str, str]]:
    """``--served-model-name``: rename the models, one name per model, in order."""
    if not names:
        return pairs
    if len(names) != len(pairs):
        raise ValueError(
            f"--served-model-name gives {len(names)} name(s) for {len(pairs)} model(s); "
            "give one name per model (qserve serves a model under one name)"
        )
    return [(name, path) for name, (_, path) in zip(names, pairs)]


def read_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the argument itself when it is not a file."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # e.g. a template too long to be a file name
        pass
    if "{" not in value:
        raise FileNotFoundError(f"--chat-template {value}: no such file (and it does not look like a template)")
    return value


def parse_model_args(values: list[str]) -> list[tuple[str, str]]:
    """``["a=/m/x", "/m/y"]`` -> ``[("a", "/m/x"), ("y", "/m/y")]``."""
    result = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            path = value
            # A Hub id is served under the id, as vLLM does; a directory under its name.
            name = value if is_hub_id(value) else (Path(value.rstrip("/")).name or value)
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
    return host_factory(plan_host(args))


def serve_step_tokens(args: argparse.Namespace) -> int:
    """The step's token budget per model: ``--max-num-batched-tokens``, else the serving default."""
    if args.max_num_batched_tokens is not None:
        return args.max_num_batched_tokens
    return max(SERVE_MAX_NUM_BATCHED_TOKENS, args.block_size)


def plan_host(args: argparse.Namespace) -> HostPlan:
    """Validate the arguments (cheap errors before the server starts): what to host, and how."""
    from qserve.engine.async_engine import SUPPORTED_KV_CACHE_DTYPES, HostConfig, ModelSpec
    from qserve.memory.planner import parse_memory_budget

    apply_worker_flags(args)
    chat_template = read_chat_template(getattr(args, "chat_template", None))
    kv_events_config = None
    if getattr(args, "kv_events_config", None):
        from qserve.engine.kv_events import parse_kv_events_config

        kv_events_config = parse_kv_events_config(args.kv_events_config)
    generation_config = getattr(args, "generation_config", "vllm")
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
    # -- swap preemption (issue 17) --
    preemption_mode = getattr(args, "preemption_mode", "recompute")
    if getattr(args, "swap_space", 4.0) < 0:
        raise ValueError(f"--swap-space must be >= 0 GiB, got {args.swap_space}")
    check_tensor_parallel_preemption(preemption_mode, tensor_parallel_size, "--preemption-mode")
    speculative_config = parse_speculative_config(getattr(args, "speculative_config", None))
    if speculative_config is not None and tensor_parallel_size > 1:
        raise ValueError(f"--speculative-config is not supported with --tensor-parallel-size {tensor_parallel_size}")
    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    separate_core = check_engine_core_process(args, tensor_parallel_size)
    pairs = apply_served_model_names(parse_model_args(values), getattr(args, "served_model_name", None))
    pairs = [(name, resolve_model_path(path, getattr(args, "revision", None))) for name, path in pairs]
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be unique, got {names}; use NAME=PATH")
    if speculative_config is not None and speculative_config.model is not None and len(pairs) > 1:
        what = "a draft model" if speculative_config.method == "draft_model" else "an EAGLE head"
        raise ValueError(f"--speculative-config with {what} serves one model; got {len(pairs)} ({', '.join(names)})")
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
            checked = check_checkpoint(path)
        except (ValueError, FileNotFoundError) as err:
            raise type(err)(f"model {name!r}: {err}") from err
        check_quantization(getattr(args, "quantization", None), checked.spec.method, name)
    lora_modules = check_lora_flags(args, names)
    if getattr(args, "enable_lora", False) and speculative_config is not None:
        raise ValueError("--enable-lora is not supported yet with --speculative-config")
    min_shares = parse_shares(args.min_share, "--min-share", names)
    max_shares = parse_shares(args.max_share, "--max-share", names)
    specs = [ModelSpec(name, path, min_shares.get(name), max_shares.get(name)) for name, path in pairs]
    config = HostConfig(
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=serve_step_tokens(args),
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_budget=args.gpu_memory_budget,
        num_kv_blocks=args.num_kv_blocks,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        preemption_mode=preemption_mode,
        swap_space=getattr(args, "swap_space", 4.0),
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        max_cpu_loras=getattr(args, "max_cpu_loras", None),
        speculative_config=speculative_config,
        enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
    )

    return HostPlan(
        specs=specs,
        config=config,
        max_queue=args.max_queue,
        kv_events_config=kv_events_config,
        port=args.port,
        separate_core=separate_core,
        tensor_parallel_size=tensor_parallel_size,
        lora_modules=lora_modules,
        generation_config=generation_config,
        chat_template=chat_template,
        api_server_count=getattr(args, "api_server_count", 1),
    )


def core_process_by_default(args: argparse.Namespace, tensor_parallel_size: int) -> bool:
    """Where ``$QSERVE_ENABLE_MULTIPROCESSING`` is unset: the engine core in its own process on CUDA
    with one rank (on the H100 it met issue 27's targets at a 1,024-token step budget, and with 300
    requests at once gave 1.04x one process's tokens a second and half its /health p99; bench/RESULTS.md), in the
    server's process on CPU (the CPU reference gains nothing there: a step's threads and the front end
    share the same few cores) and with tensor parallelism (not supported by the core process yet)."""
    from qserve.engine.engine import resolve_device

    return tensor_parallel_size == 1 and resolve_device(getattr(args, "device", None)).type == "cuda"


def check_engine_core_process(args: argparse.Namespace, tensor_parallel_size: int) -> bool:
    """Is the engine core to run in a process of its own ($QSERVE_ENABLE_MULTIPROCESSING=1; unset, by
    default on CUDA, ``core_process_by_default``; or --api-server-count above 1, which implies it as in
    vLLM: N API servers share one core)? ValueError, naming the option, for what that mode does not
    support yet."""
    from qserve.engine.core import ENABLE_MULTIPROCESSING_ENV, multiprocessing_setting

    count = getattr(args, "api_server_count", 1)
    if count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {count}")
    setting = multiprocessing_setting()
    separate = core_process_by_default(args, tensor_parallel_size) if setting is None else setting
    if count > 1:
        if setting is False:
            raise ValueError(
                f"--api-server-count {count} runs the engine core in a process of its own, under the "
                f"{count} API servers; ${ENABLE_MULTIPROCESSING_ENV}=0 asks for one process (unset it)"
            )
        if getattr(args, "tenants", None):
            raise ValueError(
                f"--tenants is not supported with --api-server-count {count}: each API server process would "
                "count its tenants' admission (max_concurrent, max_queued, tokens_per_minute) on its own; "
                "use --api-server-count 1"
            )
        separate = True
    if not separate:
        return False
    if tensor_parallel_size > 1:
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size} is not supported yet with the engine core in its "
            f"own process (${ENABLE_MULTIPROCESSING_ENV}=1 or --api-server-count > 1); serve it in one process"
        )
    return True


def run(args: argparse.Namespace) -> int:
    tenants = None
    if getattr(args, "tenants", None):  # before anything loads: a bad file is a one-line error at once
        from qserve.tenants import Tenants, load_tenants

        tenants = Tenants(load_tenants(args.tenants))
    plan = plan_host(args)
    options = app_options(args, tenants)
    if plan.api_server_count > 1:  # N API server processes over one engine core
        from qserve.commands.multi_api_server import run_api_servers

        return run_api_servers(args, plan, options)
    return serve_app(args, host_factory(plan), None, options)


def app_options(args: argparse.Namespace, tenants: object | None = None) -> dict:
    """``create_app``'s keyword arguments from the command line (the API key resolved here once;
    picklable without tenants, so an API server process of several gets them as they are)."""
    api_key = resolve_api_key(args)
    if args.max_request_bytes < 0:
        raise ValueError(f"--max-request-bytes must be >= 0, got {args.max_request_bytes}")
    return dict(
        api_key=api_key,
        allowed_hosts=resolve_allowed_hosts(args),
        max_request_bytes=args.max_request_bytes or None,
        metrics_without_key=args.metrics_without_key,
        log_requests=not args.disable_log_requests,
        log_stats=not args.disable_log_stats,
        ui=not getattr(args, "no_ui", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        tenants=tenants,
        cors=cors_config(args) if hasattr(args, "allowed_origins") else None,
    )
