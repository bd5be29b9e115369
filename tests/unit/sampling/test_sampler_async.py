"""Sampler pieces async scheduling relies on: tokens still in flight count for min_tokens and the
seeded output index, row chunks read the greedy flags from the host, sampled ids stay on the
device on request."""

from __future__ import annotations

import dataclasses

import torch

from qserve.runner.sampler import Sampler, build_sampling_metadata, slice_metadata
from qserve.sampling_params import SamplingParams

VOCAB = 32
EOS = 2


def test_pending_tokens_count_for_min_tokens_and_seeded_index() -> None:
    params = [SamplingParams(min_tokens=3, seed=5), SamplingParams(min_tokens=3, seed=5)]
    outputs = [[7, 8], [7, 8]]
    md = build_sampling_metadata(params, [[1], [1]], outputs, [EOS], VOCAB, "cpu", num_pending_tokens=[0, 1])
    assert md.output_indices == [2, 3]
    # Row 0 has 2 outputs (< 3: eos blocked); row 1 has 2 + 1 in flight (not blocked).
    assert md.min_tokens_rows.tolist() == [0]
    without = build_sampling_metadata(params, [[1], [1]], outputs, [EOS], VOCAB, "cpu")
    assert without.output_indices == [2, 2] and without.min_tokens_rows.tolist() == [0, 1]


def test_row_chunks_take_greedy_flags_from_the_host() -> None:
    params = [SamplingParams(temperature=0)] * 64 + [SamplingParams(temperature=0.7)] * 6
    md = build_sampling_metadata(params, [[1]] * 70, [[]] * 70, [EOS], VOCAB, "cpu")
    assert md.is_greedy_rows == [True] * 64 + [False] * 6
    poisoned = dataclasses.replace(md, is_greedy=torch.zeros(70, dtype=torch.bool))  # a device read would see this
    head, tail = slice_metadata(poisoned, 0, 64), slice_metadata(poisoned, 64, 70)
    assert head.all_greedy and not head.all_random
    assert tail.all_random and not tail.all_greedy
    # Without host flags (metadata built elsewhere), the device flags decide as before.
    legacy = dataclasses.replace(md, is_greedy_rows=None)
    assert slice_metadata(legacy, 0, 64).all_greedy and slice_metadata(legacy, 64, 70).all_random


def test_sampled_ids_on_device_match_the_list() -> None:
    torch.manual_seed(0)
    logits = torch.randn(70, VOCAB)
    params = [SamplingParams(temperature=0)] * 30 + [SamplingParams(temperature=0.9, seed=i) for i in range(40)]
    md = build_sampling_metadata(params, [[1]] * 70, [[3]] * 70, [EOS], VOCAB, "cpu")
    as_list, _ = Sampler(seed=1)(logits, md)
    on_device, _ = Sampler(seed=1)(logits, md.to("cpu"), on_device=True)
    assert isinstance(on_device, torch.Tensor) and on_device.dtype == torch.int64
    assert on_device.tolist() == as_list


def test_penalty_rows_get_a_slot_for_the_token_in_flight() -> None:
    """With penalties, a row whose last token is still in flight gets one more output slot, marked
    PENDING_TOKEN until the runner writes the id there; once written, the penalties are those of the
    synchronous order (the token counted as if it had reached the host)."""
    from qserve.runner.sampler import PENDING_TOKEN, apply_penalties, pending_output_slots

    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)] * 2
    outputs = [[7, 8], [7]]
    md = build_sampling_metadata(params, [[1], [1]], outputs, [EOS], VOCAB, "cpu", num_pending_tokens=[0, 1])
    assert md.output_token_ids.tolist() == [[7, 8], [7, PENDING_TOKEN]]
    assert pending_output_slots(outputs, [0, 1]) == ([1], [1])
    logits = torch.randn(2, VOCAB)
    try:
        apply_penalties(logits, md)
        raise AssertionError("an unfilled in-flight slot must not pass silently")
    except (RuntimeError, IndexError):
        pass
    md.output_token_ids[1, 1] = 8  # the id the step in flight sampled
    synchronous = build_sampling_metadata(params, [[1], [1]], [[7, 8], [7, 8]], [EOS], VOCAB, "cpu")
    assert torch.equal(apply_penalties(logits, md), apply_penalties(logits, synchronous))
    try:
        build_sampling_metadata(params, [[1], [1]], outputs, [EOS], VOCAB, "cpu", num_pending_tokens=[0, 2])
        raise AssertionError("two tokens in flight cannot be filled from one step")
    except ValueError:
        pass
