"""Generate text for one prompt and stream it to the terminal.

Knows: the ``qserve generate`` arguments and how to print a stream. Must not know: how the
engine works inside.
"""

from __future__ import annotations

import argparse
import sys

from qserve.commands.vllm_flags import add_speculative_config_argument
from qserve.model.hub import add_revision_argument, resolve_model_path


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="path to a Hugging Face model directory")
    add_revision_argument(parser)
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-budget", default=None, help="bytes (24GiB) or a fraction of the device (0.9)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype), fp8, int8 or int4")
    parser.add_argument("--enforce-eager", action="store_true", help="do not capture CUDA graphs")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule the next step while the current one runs (default: on; --no-async-scheduling: off)",
    )
    add_speculative_config_argument(parser)
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the model over this many processes (one per GPU; gloo processes on CPU)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="a MoE model's routed experts: whole experts per rank instead of a slice of each (vLLM's flag)",
    )


def run(args: argparse.Namespace) -> int:
    args.model = resolve_model_path(args.model, args.revision)  # a Hub id: its cached snapshot
    from qserve.engine.engine import Engine, EngineConfig
    from qserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    config = EngineConfig(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        gpu_memory_budget=args.gpu_memory_budget,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        speculative_config=args.speculative_config,
        enable_expert_parallel=args.enable_expert_parallel,
    )
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.tensor_parallel_size > 1:
        from qserve.engine.tensor_parallel import launch_engine

        tensor_parallel = launch_engine(config, args.tensor_parallel_size)
        try:
            return _stream(tensor_parallel.engine, args.prompt, params)
        finally:
            tensor_parallel.shutdown()
    return _stream(Engine(config), args.prompt, params)


def _stream(engine, prompt: str, params) -> int:  # noqa: ANN001 - Engine, SamplingParams
    engine.add_request("cli", prompt, params)
    shown = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    return 0
