"""Prefix caching: a hash chain over the FULL blocks of a sequence's token ids.

``hash(block i) = hash((hash(block i-1), tuple(token ids of block i)))``, and the chain of
block 0 starts from a seed derived from the owner (model), so equal token prefixes of two
models never share a hash. A block's hash therefore names the whole prefix up to its end.

Knows: token ids, the block size, the pool's ``lookup``. Must not know: torch, tensors,
the scheduler's queues. Hashes are Python's built-in tuple hash (deterministic across
processes for ints; ~61-bit, not collision-resistant against adversarial prompts).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from qserve.request import Request
from qserve.scheduler.block_pool import BlockPool


def owner_seed(owner: str) -> int:
    """The chain's starting value for one owner: stable across processes (unlike ``hash(str)``)."""
    return int.from_bytes(hashlib.sha256(b"qserve-prefix-cache:" + owner.encode()).digest()[:8], "little")


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


def update_block_hashes(request: Request, block_size: int, seed: int) -> list[int]:
    """Extend ``request.block_hashes`` to cover every full block of its tokens (prompt + outputs).

    Incremental: only blocks that became full since the last call are hashed.
    """
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if len(hashes) > num_full:  # tokens were removed (never expected; stay correct anyway)
        del hashes[num_full:]
    if len(hashes) == num_full:
        return hashes
    prompt = request.prompt_token_ids
    outputs = request.output_token_ids
    num_prompt = len(prompt)
    parent = hashes[-1] if hashes else seed
    for i in range(len(hashes), num_full):
        start, end = i * block_size, (i + 1) * block_size
        if end <= num_prompt:
            tokens = prompt[start:end]
        elif start >= num_prompt:
            tokens = outputs[start - num_prompt : end - num_prompt]
        else:
            tokens = prompt[start:] + outputs[: end - num_prompt]
        parent = hash_block_tokens(parent, tokens)
        hashes.append(parent)
    return hashes


def max_cache_hit_blocks(num_tokens: int, block_size: int) -> int:
    """At most ``num_tokens - 1`` tokens may come from the cache: the last one is always computed
    (its logits are needed to sample), so a block-aligned fully cached prompt misses its last block."""
    return max(num_tokens - 1, 0) // block_size


def find_longest_cache_hit(pool: BlockPool, block_hashes: Sequence[int], max_num_blocks: int) -> list[int]:
    """Block ids of the longest run of cached blocks from block 0 (at most ``max_num_blocks``)."""
    hit: list[int] = []
    for block_hash in block_hashes[:max_num_blocks]:
        block_id = pool.lookup(block_hash)
        if block_id is None:
            break
        hit.append(block_id)
    return hit
