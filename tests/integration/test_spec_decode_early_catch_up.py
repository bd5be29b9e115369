"""QSERVE_EAGLE_EARLY_CATCH_UP=1 (opt-in, the asynchronous order): an EAGLE head catches up on a verify
step's kept positions as soon as the step's launch returns, from the emitted tokens the verify step put on
the host, instead of when the engine processes the step. The same computation, earlier: every verify step
gets the same drafts as without it (the mixed workload, both heads, eager and through the row graphs'
StaticReplay stand-ins), greedy outputs stay those of no speculation, and an oracle head keeps its drafts
accepted (a position or token off by one collapses its acceptance)."""

from __future__ import annotations

import pytest

from qserve import LLM
from qserve.engine.engine import EAGLE_EARLY_CATCH_UP_ENV
from tests.integration.test_spec_decode import (  # noqa: F401 - path, reference: fixtures
    ARGS,
    _assert_same,
    _run,
    path,
    reference,
)
from tests.integration.test_spec_decode_device_drafts import _verify_inputs, assert_engine_walks
from tests.integration.test_spec_decode_eagle import _spec, heads, walk  # noqa: F401 - fixtures
from tests.integration.test_spec_decode_graphs import install_graphs


def _engine(path: str, heads: dict, method: str, graphs: bool, **kwargs):  # noqa: ANN202, F811
    llm = LLM(path, async_scheduling=True, speculative_config=_spec(heads, method), **ARGS, **kwargs)
    if graphs:
        install_graphs(llm)
    return llm.engine


def _count_early(engine) -> list[int]:  # noqa: ANN001
    """How many sequences each launch-time catch-up covered (spied on the engine)."""
    calls: list[int] = []
    observe = engine._observe_verified_at_launch

    def spy(scheduler_output, launched):  # noqa: ANN001, ANN202
        observe(scheduler_output, launched)
        calls.append(len(engine._caught_up_at_launch))

    engine._observe_verified_at_launch = spy
    return calls


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_early_catch_up_gives_every_verify_step_the_same_drafts(path, heads, reference, method, graphs, monkeypatch):  # noqa: F811
    requests, want, _ = reference
    runs, early = {}, []
    for switch in ("0", "1"):
        monkeypatch.setenv(EAGLE_EARLY_CATCH_UP_ENV, switch)
        engine = _engine(path, heads, method, graphs)
        engine._draft_backoff.max_wait = 1  # propose (nearly) every step although random drafts fail
        if switch == "1":
            early = _count_early(engine)
        runs[switch] = _verify_inputs(engine, requests, monkeypatch)
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert runs["1"] == runs["0"]
    assert len(runs["0"]) >= 10
    assert early and sum(early) > 0, "verify steps were caught up at launch"
    engine = _engine(path, heads, method, graphs)  # the switch still on: the outputs
    got, _ = _run(engine, requests)
    _assert_same(got, want)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_oracle_head_keeps_its_drafts_accepted_with_early_catch_up(walk, method, monkeypatch):  # noqa: F811
    monkeypatch.setenv(EAGLE_EARLY_CATCH_UP_ENV, "1")
    target, oracle, perm = walk
    engine = _engine(target, oracle, method, graphs=True)
    early = _count_early(engine)
    assert_engine_walks(engine, perm)
    assert sum(early) >= 10


def test_the_switch_takes_only_0_or_1(path, heads, monkeypatch):  # noqa: F811
    monkeypatch.setenv(EAGLE_EARLY_CATCH_UP_ENV, "yes")
    with pytest.raises(ValueError, match=EAGLE_EARLY_CATCH_UP_ENV):
        _engine(path, heads, "eagle", graphs=False)
