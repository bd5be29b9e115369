"""The back-off (qserve.spec_decode.backoff) on the CPU engine: while it holds every running sequence
(its proposals keep failing: an EAGLE head whose drafts are never accepted, the 0%-acceptance case of
issue 29), the steps between its probes are plain decode steps as without speculation: no hidden
states captured for the head, and in the asynchronous order no step processed before the next is
launched. Only the step before a probe is captured (the head catches up over the skipped positions
there), and the greedy outputs stay those of no speculation.

On the H100 (bench/RESULTS.md, twelfth session) a random head at batch 1 ran at 0.79x no speculation
with adaptive k, and 0.70-0.77x with k = 4, although the back-off let it verify only 10 of 127
steps: every other step was synchronized and carried the head's catch-up all the same."""

from __future__ import annotations

import pytest

from qserve import LLM
from tests.integration.test_spec_decode import (  # noqa: F401 - path: fixture
    ARGS,
    LOOP,
    _greedy,
    path,
)
from tests.integration.test_spec_decode_eagle import _spec, heads  # noqa: F401 - heads: fixture

MAX_TOKENS = 60


@pytest.fixture(scope="module")
def plain_tokens(path) -> list[int]:  # noqa: F811
    llm = LLM(path, async_scheduling=False, **ARGS)
    return (
        llm.generate([{"prompt_token_ids": LOOP}], _greedy(max_tokens=MAX_TOKENS), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
def test_steps_the_back_off_holds_run_as_plain_decode(path, heads, plain_tokens, async_scheduling, adaptive):  # noqa: F811
    extra = {"enable_adaptive_verification": True} if adaptive else {}
    llm = LLM(path, async_scheduling=async_scheduling, speculative_config=_spec(heads, "eagle", **extra), **ARGS)
    engine = llm.engine
    if adaptive:  # the draft cost of a one-layer head over a 48-layer target (the tiny target has 2 layers)
        engine.adaptive_speculation.draft_cost = 0.05
    launches = []  # (verifies drafts, plain decode step, hidden states captured, launched after processing the one before)
    launch = engine.runner.launch

    def spy(scheduler_output, previous=None):  # noqa: ANN001, ANN202
        plain = scheduler_output.num_batched_tokens == len(scheduler_output.sequences)
        launches.append(
            (scheduler_output.num_spec_tokens > 0, plain, scheduler_output.spec_hidden_states, previous is None)
        )
        return launch(scheduler_output, previous)

    engine.runner.launch = spy
    got = llm.generate([{"prompt_token_ids": LOOP}], _greedy(max_tokens=MAX_TOKENS), use_tqdm=False)[0].outputs[0]
    assert got.token_ids == plain_tokens
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0, "the random head's drafts all fail"
    verify = sum(v for v, _, _, _ in launches)
    plain = [(captured, synced) for v, p, captured, synced in launches if p and not v]
    assert len(plain) >= 4 * verify, "the back-off held most steps"
    # the step before each probe carries the head's hidden states; the others none
    assert sum(captured for captured, _ in plain) <= verify + 1
    if async_scheduling:  # each probe processes two steps first: the one before it, and its verify
        assert sum(synced for _, _, _, synced in launches) <= 2 * verify + 2


def test_an_eagle_head_backs_off_faster_than_the_n_gram_default(path, heads, plain_tokens, monkeypatch):  # noqa: F811
    """An EAGLE head's default back-off is 4,64 (a failed probe costs it about a step: measured 0.97x vs
    0.91x no speculation at 0% acceptance on an H100), n-gram's 2,16: the same outputs, fewer verify
    steps than with QSERVE_SPEC_BACKOFF=2,16; a value that is not GROWTH,MAX_WAIT stops the engine with an
    error naming the variable."""
    from qserve.engine.engine import SPEC_BACKOFF_ENV

    verify_steps = {}
    for value in ("", "2,16"):
        monkeypatch.setenv(SPEC_BACKOFF_ENV, value)
        llm = LLM(path, speculative_config=_spec(heads, "eagle"), **ARGS)
        backoff = llm.engine._draft_backoff
        assert (backoff.growth, backoff.max_wait) == ((4, 64) if value == "" else (2, 16))
        got = llm.generate([{"prompt_token_ids": LOOP}], _greedy(max_tokens=MAX_TOKENS), use_tqdm=False)
        assert got[0].outputs[0].token_ids == plain_tokens
        stats = llm.engine.spec_stats
        assert stats.num_accepted_tokens == 0
        verify_steps[value] = stats.num_drafts
    assert verify_steps[""] < verify_steps["2,16"]
    monkeypatch.setenv(SPEC_BACKOFF_ENV, "")
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    backoff = LLM(path, speculative_config=ngram, **ARGS).engine._draft_backoff
    assert (backoff.growth, backoff.max_wait) == (2, 16)
    monkeypatch.setenv(SPEC_BACKOFF_ENV, "64")
    with pytest.raises(ValueError, match=SPEC_BACKOFF_ENV):
        LLM(path, speculative_config=_spec(heads, "eagle"), **ARGS)


def test_a_full_batch_keeps_the_asynchronous_order(path, heads):  # noqa: F811
    """max_num_seqs sequences running leave no logit rows for drafts: nothing is proposed, so nothing needs
    the step in flight processed first (every step was synchronized before: found in review)."""
    llm = LLM(path, async_scheduling=True, max_num_seqs=2, speculative_config=_spec(heads, "eagle"), **ARGS)
    engine = llm.engine
    synced = []
    launch = engine.runner.launch

    def spy(scheduler_output, previous=None):  # noqa: ANN001, ANN202
        synced.append(previous is None)
        return launch(scheduler_output, previous)

    engine.runner.launch = spy
    prompts = [{"prompt_token_ids": LOOP}, {"prompt_token_ids": LOOP[::-1]}]
    llm.generate(prompts, _greedy(max_tokens=30), use_tqdm=False)
    assert engine.spec_stats.num_draft_tokens == 0
    assert len(synced) >= 25 and sum(synced) <= 2


def test_the_back_off_variable_is_read_only_when_speculating(path, monkeypatch):  # noqa: F811
    from qserve.engine.engine import SPEC_BACKOFF_ENV

    monkeypatch.setenv(SPEC_BACKOFF_ENV, "64")
    LLM(path, **ARGS)  # no speculation: the variable is not its business


def test_a_request_that_never_proposes_leaves_held_steps_plain(path, heads, plain_tokens):  # noqa: F811
    """A structured-output request (never given drafts) running beside a sequence the back-off holds:
    the held steps carry no hidden states for the head (they keep the plain decode graphs), as alone.
    Before, the structured request counted as one that might propose (the back-off holds only
    sequences whose proposals failed), so every step captured the target's hidden states."""
    from qserve import SamplingParams
    from qserve.sampling_params import StructuredOutputsParams

    llm = LLM(path, speculative_config=_spec(heads, "eagle"), **ARGS)
    engine = llm.engine
    launches = []  # (verifies drafts, plain decode step, hidden states captured)
    launch = engine.runner.launch

    def spy(scheduler_output, previous=None):  # noqa: ANN001, ANN202
        plain = scheduler_output.num_batched_tokens == len(scheduler_output.sequences)
        launches.append((scheduler_output.num_spec_tokens > 0, plain, scheduler_output.spec_hidden_states))
        return launch(scheduler_output, previous)

    engine.runner.launch = spy
    grammar = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(regex="[ab ]{400}")
    )
    got = llm.generate(
        [{"prompt_token_ids": LOOP}, "ab ab ab"], [_greedy(max_tokens=MAX_TOKENS), grammar], use_tqdm=False
    )
    assert got[0].outputs[0].token_ids == plain_tokens
    assert len(got[1].outputs[0].token_ids) == MAX_TOKENS and set(got[1].outputs[0].text) <= set("ab ")
    assert engine.spec_stats.num_draft_tokens > 0 and engine.spec_stats.num_accepted_tokens == 0
    verify = sum(v for v, _, _ in launches)
    plain = [captured for v, p, captured in launches if p and not v]
    assert len(plain) >= 4 * verify, "the back-off held most steps"
    # the step before each probe carries the head's hidden states; the others none
    assert sum(plain) <= verify + 1


def test_a_preempted_sequence_keeps_its_back_off(path, heads):  # noqa: F811
    """Preemption drops a sequence's proposer state (its head's KV went with the target's pages) but not
    its back-off: it resumes with the same text, so its proposals fail as before (before, each preemption
    started a failing sequence's back-off over, at one step). Only finished requests are forgotten."""
    llm = LLM(
        path, speculative_config=_spec(heads, "eagle"), num_kv_blocks=24, max_num_batched_tokens=16, **ARGS
    )  # fmt: skip
    engine = llm.engine
    engine.scheduler.watermark, engine.scheduler.watermark_per_running = 0.0, 0  # preempt, don't hold back
    backoff = engine._draft_backoff
    forget = backoff.forget
    unfinished_forgotten = []

    def spy(request_ids):  # noqa: ANN001, ANN202
        request_ids = list(request_ids)
        live = {r.request_id for r in engine.scheduler.running} | {r.request_id for r in engine.scheduler.waiting}
        unfinished_forgotten.extend(i for i in request_ids if i in live)
        return forget(request_ids)

    backoff.forget = spy
    prompts = [{"prompt_token_ids": LOOP[i:] + LOOP[:i]} for i in range(4)]
    want = LLM(path, **ARGS).generate(prompts, _greedy(max_tokens=30), use_tqdm=False)
    got = llm.generate(prompts, _greedy(max_tokens=30), use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert engine.num_preemptions > 0, "the tiny pool should force preemptions"
    assert engine.spec_stats.num_draft_tokens > 0
    assert unfinished_forgotten == []
    assert not backoff._state, "finished requests' back-off is dropped"
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
