"""Print the memory plan for serving a model under a budget, without loading weights or a GPU.

Knows: the ``qserve plan`` arguments and how to print a ``MemoryPlan``. Reads only
``config.json`` and the checkpoint's quantization metadata (a directory holding just
``config.json`` works); with ``--speculative-config`` naming a draft model or an EAGLE head, its
weights count too (an EAGLE head's from its safetensors headers), and its KV cache indexed by the
target's blocks as a larger page; speculation's verify rows need no
more: a step's drafts stay within the ``max_num_seqs`` logit rows and ``max_num_batched_tokens``
tokens already planned.
"""

from __future__ import annotations

import argparse
import json

from qserve.commands.serve import SERVE_MAX_NUM_BATCHED_TOKENS, serve_step_tokens
from qserve.commands.vllm_flags import add_speculative_config_argument
from qserve.model.hub import add_revision_argument, resolve_model_path
from qserve.model.registry import read_model_config
from qserve.spec_decode.config import check_tensor_parallel_speculation, parse_speculative_config


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model directory (config.json with its quantization_config is enough)")
    add_revision_argument(parser)
    parser.add_argument("--gpu-memory-budget", required=True, help="bytes (24GiB, 22000MB) or a fraction (0.9)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype), fp8, int8 or int4")
    parser.add_argument(
        "--dtype", default="auto", help="activation dtype on the GPU (auto: the checkpoint's fp16/bf16)"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"tokens per step (default qserve serve's: {SERVE_MAX_NUM_BATCHED_TOKENS}, or the block size if larger)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--device-memory", default=None, help="card size, to resolve a fractional budget (e.g. 24GiB)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="plan one rank of this many")
    parser.add_argument(
        "--enable-expert-parallel", action="store_true", help="a MoE model: each rank holds whole experts (E / N)"
    )
    parser.add_argument("--enable-lora", action="store_true", help="set aside LoRA adapter slots (qserve serve's flag)")
    parser.add_argument("--max-loras", type=int, default=1, help="adapter slots on the device (with --enable-lora)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the rank the slots are sized for")
    add_speculative_config_argument(parser)  # a draft model's weights count in the plan


def run(args: argparse.Namespace) -> int:
    args.model = resolve_model_path(args.model, args.revision)  # a Hub id: its cached snapshot
    speculative = parse_speculative_config(args.speculative_config)
    check_tensor_parallel_speculation(speculative, args.tensor_parallel_size)
    import torch

    import loaders
    from qserve.config import parse_dtype
    from qserve.memory.planner import lora_slot_bytes, make_plan, parse_memory_budget, weight_bytes
    from qserve.runner.piecewise_graphs import piecewise_enabled

    config = read_model_config(args.model)
    spec = loaders.detect(args.model)
    if args.dtype == "auto":
        dtype = config.dtype if config.dtype in (torch.float16, torch.bfloat16) else torch.float16
    else:
        dtype = parse_dtype(args.dtype)
    total = parse_memory_budget(args.device_memory) if args.device_memory else None
    if total is None and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
    weights = weight_bytes(config, spec, dtype, args.tensor_parallel_size, args.enable_expert_parallel)
    draft_bytes = shadow_per_token = shadow_scratch = 0
    if speculative is not None and speculative.method == "draft_model":  # loaded beside the target
        from qserve.spec_decode.shadow_kv import num_scratch_blocks, shadow_kv_bytes_per_token

        draft_config = read_model_config(speculative.model)
        draft_bytes = weight_bytes(draft_config, loaders.detect(speculative.model), dtype, 1)
        # its KV indexed by the target's blocks: every page grows by the draft's share
        shadow_per_token = shadow_kv_bytes_per_token(draft_config, dtype)
        k, block_size = speculative.num_speculative_tokens, args.block_size
        shadow_scratch = num_scratch_blocks(args.max_num_seqs, k, block_size, draft=True)
    elif speculative is not None and speculative.is_eagle:  # an EAGLE head: dense, in the model dtype
        from qserve.spec_decode.eagle_config import read_eagle_config
        from qserve.spec_decode.eagle_head import eagle_head_bytes
        from qserve.spec_decode.shadow_kv import num_scratch_blocks, shadow_kv_bytes_per_token

        draft_bytes = eagle_head_bytes(speculative.model, speculative.method, dtype, speculative.draft_layers == "int4")
        head_config = read_eagle_config(speculative.model, speculative.method, config)
        if speculative.draft_lm_head == "int4":  # a 4-bit copy of the lm_head it drafts with, beside it
            from qserve.spec_decode.draft_lm_head import planned_bytes

            hidden = head_config.model.hidden_size
            if speculative.method == "eagle3":  # in place of its own dense lm_head
                vocab = head_config.draft_vocab_size
                draft_bytes -= vocab * hidden * torch.empty((), dtype=dtype).element_size()
            else:  # beside the target's
                vocab = config.vocab_size
            draft_bytes += planned_bytes(vocab, hidden, dtype)
        # its KV indexed by the target's blocks: every page grows by the head's share
        head = head_config.model
        shadow_per_token = shadow_kv_bytes_per_token(head, dtype)
        shadow_scratch = num_scratch_blocks(args.max_num_seqs, speculative.num_speculative_tokens, args.block_size)
    step_tokens = serve_step_tokens(args)  # the budget qserve serve would step with
    plan = make_plan(
        config,
        weights_bytes=weights + draft_bytes,
        budget_bytes=parse_memory_budget(args.gpu_memory_budget, total),
        dtype=dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=step_tokens,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        lora_bytes=lora_slot_bytes(
            config, args.max_loras, args.max_lora_rank, dtype, args.tensor_parallel_size, args.enable_expert_parallel
        )
        if args.enable_lora
        else 0,
        shadow_kv_bytes_per_token=shadow_per_token,
        shadow_scratch_blocks=shadow_scratch,
        # the engine's default on CUDA (qserve.runner.piecewise_graphs): pieces for steps up to the step budget,
        # except under tensor parallelism, whose steps stay eager
        piecewise_graph_tokens=(
            step_tokens if piecewise_enabled(torch.device("cuda")) and args.tensor_parallel_size == 1 else 0
        ),
    )
    if args.json:
        extra = {"draft_weights_bytes": draft_bytes} if draft_bytes else {}
        print(json.dumps({"model": args.model, "format": spec.method, **plan.to_json(), **extra}))
    else:
        print(f"model {args.model} ({config.architecture}, {spec.method})")
        if draft_bytes:
            what = "draft model" if speculative.method == "draft_model" else f"{speculative.method} head"
            print(f"{what} {speculative.model}: {draft_bytes / 2**30:.2f} GiB of the weights below")
        print(plan.describe())
    return 0
