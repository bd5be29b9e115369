"""How many KV pages fit: the arithmetic that turns a memory budget into blocks.

Knows: bytes per KV block for a model and the budget rules. Must not know: the scheduler or
the weights' contents. (The full GPU planner with a measured activation peak extends this.)
"""

from __future__ import annotations

import math

import torch

from qserve.config import ModelConfig

CPU_KV_BUDGET_BYTES = 1 << 30  # the CPU path is for tests and demos: 1 GiB of KV is plenty
GPU_FREE_FRACTION = 0.85  # of the memory still free after the weights loaded


def kv_block_bytes(config: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    return config.kv_bytes_per_token(torch.empty((), dtype=kv_dtype).element_size()) * block_size


def plan_num_kv_blocks(
    config: ModelConfig,
    kv_dtype: torch.dtype,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    device: torch.device,
) -> int:
    """Blocks for the KV pool: never more than ``max_num_seqs`` full-length sequences need."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * GPU_FREE_FRACTION)
    else:
        budget = CPU_KV_BUDGET_BYTES
    block_bytes = kv_block_bytes(config, block_size, kv_dtype)
    blocks_per_seq = math.ceil(max_model_len / block_size)
    num_blocks = min(budget // block_bytes, blocks_per_seq * max_num_seqs)
    if num_blocks < blocks_per_seq:
        largest = num_blocks * block_size
        raise ValueError(
            f"one sequence of max_model_len={max_model_len} tokens needs {blocks_per_seq * block_bytes} bytes of KV "
            f"but only {budget} are available; the largest context that fits is {largest} tokens (--max-model-len)"
        )
    return int(num_blocks)
