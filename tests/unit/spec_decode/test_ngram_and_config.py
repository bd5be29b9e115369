"""The n-gram proposer (prompt lookup over the sequence's own tokens) and ``speculative_config``
validation (vLLM's keys; every error names the key)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qserve.spec_decode import ProposalInput, SpeculativeConfig, parse_speculative_config
from qserve.spec_decode.config import DEFAULT_ROW_COST
from qserve.spec_decode.metrics import SpecDecodeStats
from qserve.spec_decode.ngram import NgramProposer, ngram_lookup


def _lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return ngram_lookup(np.array(tokens, dtype=np.int64), min_n, max_n, k)


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule spelled out: longest n first, most recent earlier occurrence, the continuation
    read from the sequence as if it went on repeating (an overlapping copy)."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + n + i])
                return extended[start + n : start + n + k]
    return []


def test_lookup_prefers_the_longest_then_the_most_recent_match():
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert _lookup(tokens, 1, 3, 3) == [4, 9, 2]  # "1 2 3" occurred at the start
    assert _lookup(tokens, 1, 2, 3) == [5, 6, 1]  # "2 3": the most recent is at 5..6
    assert _lookup(tokens, 4, 5, 3) == []  # no 4-gram repeats
    assert _lookup(tokens, 1, 3, 0) == []
    assert _lookup([7, 7], 1, 1, 5) == [7] * 5  # a loop goes on past the end of the sequence
    assert _lookup([4, 8, 1, 2, 1, 2], 2, 2, 5) == [1, 2, 1, 2, 1]
    assert _lookup([5], 1, 3, 2) == []


def test_lookup_matches_the_brute_force_rule_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        k = int(rng.integers(1, 5))
        assert _lookup(tokens, min_n, max_n, k) == _brute_force(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_proposer_keeps_a_growing_buffer_per_request():
    proposer = NgramProposer(1, 2)
    prompt = [1, 2, 3, 1, 2]
    output: list[int] = []
    assert proposer.propose([ProposalInput("a", prompt, output, 2)]) == [[3, 1]]
    assert proposer.propose([ProposalInput("a", prompt, output, 5)]) == [[3, 1, 2, 3, 1]]
    output += [3] * 200  # grows past the buffer
    assert proposer.propose([ProposalInput("a", prompt, output, 2), ProposalInput("b", [4, 5], [], 3)]) == [[3, 3], []]
    assert proposer.propose([ProposalInput("a", prompt, output, 0)]) == [[]]
    proposer.forget(["a", "b"])
    assert not proposer._buffers


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"method": "ngram", "num_speculative_tokens": 4}, SpeculativeConfig("ngram", 4, 5, 5)),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}',
            SpeculativeConfig("ngram", 3, 4, 1),
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, SpeculativeConfig("ngram", 2, 3, 3)),
        (
            {"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2},
            SpeculativeConfig("ngram", 2, 2, 2),
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8},
            SpeculativeConfig("ngram", 2, 5, 5, 8),
        ),
        (
            {"method": "draft_model", "model": "/m", "num_speculative_tokens": 3},
            SpeculativeConfig("draft_model", 3, 5, 5, None, "/m"),
        ),
        (
            {"method": "eagle", "model": "/h", "num_speculative_tokens": 3},
            SpeculativeConfig("eagle", 3, 5, 5, None, "/h"),
        ),
        (
            {
                "method": "eagle3",
                "model": "/h",
                "num_speculative_tokens": 5,
                "enable_adaptive_verification": True,
                "adaptive_verification_row_cost": 0.05,
            },
            SpeculativeConfig("eagle3", 5, 5, 5, None, "/h", True, 0.05),
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "enable_adaptive_verification": False},
            SpeculativeConfig("ngram", 2, 5, 5, None, None, False, DEFAULT_ROW_COST),
        ),
        (None, None),
    ],
)
def test_config_parses_vllm_keys(value, expected):
    assert parse_speculative_config(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "speculative_config is not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"num_speculative_tokens": 2}, r"speculative_config\.method is required"),
        ({"method": "medusa", "num_speculative_tokens": 2}, r"'medusa' is not supported \(not implemented.*eagle3"),
        (
            {"method": "eagle3", "num_speculative_tokens": 2},
            r"speculative_config\.model is required with method 'eagle3'",
        ),
        ({"method": "eagle", "model": "", "num_speculative_tokens": 2}, r"speculative_config\.model is required"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "enable_adaptive_verification": "yes"},
            r"speculative_config\.enable_adaptive_verification must be true or false",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "adaptive_verification_row_cost": 0},
            r"speculative_config\.adaptive_verification_row_cost must be a number > 0",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "adaptive_verification_row_cost": True},
            r"adaptive_verification_row_cost",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative_config\.model is required"),
        ({"method": "ngram"}, r"speculative_config\.num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"speculative_config\.num_speculative_tokens must be >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, r"speculative_config\.num_speculative_tokens must be an"),
        ({"method": "ngram", "num_speculative_tokens": True}, r"speculative_config\.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, r"\.prompt_lookup_min must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3}, "<="),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, r"\.disable_by_batch_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, r"\.draft_tensor_parallel"),
        ({"method": "ngram", "model": "m", "num_speculative_tokens": 2}, r"speculative_config\.model"),
    ],
)
def test_config_errors_name_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(value)


def test_disable_by_batch_size():
    config = parse_speculative_config(
        json.dumps({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4})
    )
    assert config.proposes_at(4) and not config.proposes_at(5)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}).proposes_at(10_000)


def test_stats_count_drafts_tokens_and_positions():
    stats = SpecDecodeStats(3)
    stats.observe(3, 2)
    stats.observe(1, 0)
    stats.observe(3, 3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 7, 5)
    assert stats.accepted_per_pos == [2, 2, 1]
    assert stats.acceptance_rate == pytest.approx(5 / 7)


def test_backoff_skips_more_steps_while_proposals_fail_and_resets_on_acceptance():
    from qserve.spec_decode.backoff import DraftBackoff

    backoff = DraftBackoff(max_wait=4)

    def allowed_pattern(steps: int) -> list[bool]:
        return [backoff.allow("a") for _ in range(steps)]

    assert allowed_pattern(2) == [True, True]
    backoff.observe("a", 0)  # failed: skip 1
    assert allowed_pattern(2) == [False, True]
    backoff.observe("a", 0)  # failed again: skip 2
    assert allowed_pattern(3) == [False, False, True]
    backoff.observe("a", 0)
    backoff.observe("a", 0)  # capped at 4
    assert allowed_pattern(5) == [False] * 4 + [True]
    backoff.observe("a", 2)  # accepted: back to every step
    assert allowed_pattern(2) == [True, True]
    backoff.observe("b", 0)
    backoff.forget(["b"])
    assert backoff.allow("b")


def test_backoff_ready_tells_the_next_allow_without_counting_a_step():
    from qserve.spec_decode.backoff import DraftBackoff

    backoff = DraftBackoff(max_wait=4)
    assert backoff.ready("a")  # never seen
    backoff.observe("a", 0)
    backoff.observe("a", 0)  # skip 2
    pattern = []
    for _ in range(3):
        ready = backoff.ready("a")
        assert backoff.ready("a") == ready  # asking again changes nothing
        allowed = backoff.allow("a")
        pattern.append((ready, allowed))
    assert pattern == [(False, False), (False, False), (True, True)]


def test_backoff_growth_and_cap_from_the_environment_value():
    from qserve.spec_decode.backoff import MAX_WAIT_STEPS, parse_backoff

    for unset in (None, "", " "):
        backoff = parse_backoff(unset)
        assert (backoff.growth, backoff.max_wait) == (2, MAX_WAIT_STEPS)
    backoff = parse_backoff("4,64")
    waits = []
    for _ in range(5):
        backoff.observe("a", 0)
        skipped = 0
        while not backoff.allow("a"):
            skipped += 1
        waits.append(skipped)
    assert waits == [1, 4, 16, 64, 64]
    for bad in ("4", "4,64,2", "a,16", "0,16", "4,0", "4;64"):
        with pytest.raises(ValueError, match="QSERVE_SPEC_BACKOFF"):
            parse_backoff(bad)
