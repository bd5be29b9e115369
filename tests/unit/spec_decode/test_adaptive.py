"""The adaptive speculation policy (enable_adaptive_verification): expected tokens, the step's cost,
the choice of k against brute force, its behaviour in batch size and acceptance, and the
per-position estimates (counted, decaying, chained to the position before)."""

from __future__ import annotations

import itertools
import random

import pytest

from qserve.spec_decode.adaptive import AdaptiveSpeculation, choose_num_tokens, expected_tokens, step_cost


@pytest.mark.parametrize("a", [0.0, 0.3, 0.75, 0.99])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_expected_tokens_is_the_geometric_sum(a, k):
    assert expected_tokens([a] * k, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    assert expected_tokens([1.0] * k, k) == k + 1


def test_step_cost_counts_rows_and_draft_forwards():
    assert step_cost(0, 8, 0.25) == 1 + 0.25 * 8
    assert step_cost(3, 8, 0.25) == 1 + 0.25 * 8 * 4
    assert step_cost(3, 8, 0.25, draft_cost=0.1) == pytest.approx(1 + 0.25 * 32 + 3 * 0.1 * (1 + 0.25 * 8))


def test_the_choice_maximizes_tokens_per_cost_by_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        k_max = rng.randint(1, 6)
        rates = [rng.random() for _ in range(k_max)]
        batch, row, draft = rng.randint(1, 256), rng.choice([1 / 64, 1 / 32, 0.2, 1.0]), rng.choice([0, 0.05, 0.3])
        values = [expected_tokens(rates, k) / step_cost(k, batch, row, draft) for k in range(k_max + 1)]
        k = choose_num_tokens(rates, k_max, batch, row, draft)
        assert values[k] == pytest.approx(max(values))
        assert all(values[j] < values[k] * (1 + 1e-9) for j in range(k))  # ties go to the smaller k


def test_speculation_fades_as_the_batch_grows_and_acceptance_falls():
    for a in (0.5, 0.7, 0.9):
        ks = [choose_num_tokens([a] * 4, 4, batch, 1 / 32) for batch in (1, 4, 16, 64, 256, 1024)]
        assert ks == sorted(ks, reverse=True), (a, ks)
        assert ks[0] > 0 and ks[-1] == 0, (a, ks)  # on for one sequence, off for a full card
    for batch in (1, 8, 32):
        ks = [choose_num_tokens([a] * 4, 4, batch, 1 / 32) for a in (0.05, 0.3, 0.6, 0.9, 0.99)]
        assert ks == sorted(ks), (batch, ks)
    assert choose_num_tokens([0.0] * 4, 4, 1, 1 / 32) == 0  # drafts never kept: never worth a row
    # drafts always kept and free to make: every row pays, whatever the batch
    assert choose_num_tokens([1.0] * 4, 4, 4096, 1 / 32) == 4
    # a draft forward that costs as much as the target's: perfect drafts only break even
    assert choose_num_tokens([1.0] * 4, 4, 1, 1 / 32, draft_cost=1.0) == 0


def test_estimates_count_the_positions_tried_and_follow_the_position_before():
    policy = AdaptiveSpeculation(max_k=3, row_cost=1 / 32, prior=0.8, prior_weight=2.0)
    assert policy.rates == [0.8, 0.8, 0.8]
    policy.observe(num_drafts=3, num_accepted=1)  # position 0 kept, 1 rejected, 2 never tried
    r0 = (1 + 2 * 0.8) / 3
    r1 = (0 + 2 * r0) / 3
    assert policy.rates == pytest.approx([r0, r1, r1])  # position 2 follows position 1
    policy.observe(num_drafts=1, num_accepted=1)  # only position 0 tried
    assert policy.rates[0] == pytest.approx((2 + 2 * 0.8) / 4)
    for _ in range(50):
        policy.observe(num_drafts=3, num_accepted=3)
    assert all(r > 0.9 for r in policy.rates)
    assert policy.num_tokens(1) == 3


def test_measurements_fade_so_a_stopped_policy_tries_again():
    policy = AdaptiveSpeculation(max_k=2, row_cost=1 / 32, draft_cost=0.1, memory_steps=8)
    for _ in range(40):
        policy.observe(num_drafts=2, num_accepted=0)
    assert policy.num_tokens(1) == 0 and policy.rates[0] < 0.1
    steps = 0
    while policy.num_tokens(1) == 0:  # no speculation, no measurement: the prior comes back
        policy.end_step()
        steps += 1
        assert steps < 200
    assert policy.rates[0] > 0.1
    with pytest.raises(ValueError, match="max_k"):
        AdaptiveSpeculation(max_k=0, row_cost=0.1)
    with pytest.raises(ValueError, match="row_cost"):
        AdaptiveSpeculation(max_k=1, row_cost=0.0)


def test_num_tokens_has_no_side_effects():
    policy = AdaptiveSpeculation(max_k=4, row_cost=1 / 32, draft_cost=0.1)
    before = list(policy.rates)
    for batch in itertools.chain(range(1, 20), [0, 500]):
        policy.num_tokens(batch)
    assert policy.rates == before
