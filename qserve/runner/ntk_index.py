"""Which of Qwen v1's dynamic-NTK rotary tables a sequence reads: a host-side integer rule of its prompt
length, fixed at prefill.

Knows: the rule (alpha = 2^(k + 1) - 1 with k = ceil(log2(L / S)) for a prompt of L tokens past the
model's ``seq_length`` S; table k). Must not know: the tables themselves (``qserve.layers.rotary`` builds
them and counts them with ``ntk_alpha_index``), models or requests. The runner reads every sequence's index
each step (``ntk_alpha_indices``), so the rule lives here, below both.
"""

from __future__ import annotations

import numpy as np


def ntk_alpha_index(prompt_len: int, seq_length: int) -> int:
    """Qwen v1's dynamic NTK, fixed per sequence at prefill from its prompt length L:
    alpha = max(2^ceil(log2(L / S) + 1) - 1, 1) = 2^(k + 1) - 1 with k = ceil(log2(L / S)) for
    L > S. Returns k (0 for L <= S), the index of the sequence's table. Integer arithmetic."""
    k = 0
    while seq_length << k < prompt_len:
        k += 1
    return k


def ntk_alpha_indices(prompt_lens: np.ndarray, seq_length: int) -> np.ndarray:
    """``ntk_alpha_index`` of every sequence at once (int64 [S] -> int64 [S]), for the runner's
    per-step table indices. The smallest k with S * 2^k >= L is the bit length of (L - 1) // S;
    ``frexp``'s exponent is that bit length, exact for any length below 2^53."""
    quotient = (np.maximum(prompt_lens, 1) - 1) // seq_length  # [S]
    return np.frexp(quotient.astype(np.float64))[1].astype(np.int64)
