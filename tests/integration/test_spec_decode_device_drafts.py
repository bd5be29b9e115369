"""QSERVE_EAGLE_DEVICE_DRAFTS (default on; "0" off): an EAGLE head's drafts stay on the device (no host sync between drafting and
the verify step, which reads them there: as input ids, the rejection sampler's drafts and, where penalties
read them, the rows' output ids). Greedy outputs stay token-identical to no speculation over the mixed
workload (both step orders; eager and through the row graphs, StaticReplay stand-ins on CPU); every verify
step sees exactly the draft ids and penalty inputs the host-drafts path gives it; the host path's
``propose`` is never called."""

from __future__ import annotations

import pytest
import torch

from qserve import LLM
from qserve.engine.engine import EAGLE_DEVICE_DRAFTS_ENV
from qserve.runner import model_runner
from tests.helpers.eagle_heads import PERM_FIRST, walk_tokens
from tests.integration.test_spec_decode import (  # noqa: F401 - path, reference: fixtures
    ARGS,
    _assert_same,
    _greedy,
    _run,
    path,
    reference,
)
from tests.integration.test_spec_decode_eagle import (  # noqa: F401 - heads, walk: fixtures
    _assert_cuda_heads_keep_the_outputs,
    _assert_oracle_heads_walk,
    _spec,
    heads,
    walk,
)
from tests.integration.test_spec_decode_graphs import install_graphs


def _engine(path: str, heads: dict, method: str, graphs: bool, **kwargs):  # noqa: ANN202, F811
    llm = LLM(path, speculative_config=_spec(heads, method), **ARGS, **kwargs)
    if graphs:
        install_graphs(llm)
    return llm.engine


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_device_drafts_keep_the_greedy_outputs(path, heads, reference, method, async_scheduling, graphs, monkeypatch):  # noqa: F811
    monkeypatch.setenv(EAGLE_DEVICE_DRAFTS_ENV, "1")
    requests, want, _ = reference
    engine = _engine(path, heads, method, graphs, async_scheduling=async_scheduling)
    proposer, runner = engine.proposer, engine.runner
    proposer.propose = lambda batch: pytest.fail("the host path proposed")  # noqa: ARG005
    verified, row_replays = [], []
    launch = runner.launch

    def spy(scheduler_output, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if scheduler_output.num_spec_tokens:
            verified.append(scheduler_output.spec_device_drafts is not None)
        return launch(scheduler_output, *args, **kwargs)

    runner.launch = spy
    if graphs:
        replay_rows = runner.row_graphs.replay_rows

        def rows_spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            row_replays.append(kwargs.get("device_inputs") is not None)
            return replay_rows(*args, **kwargs)

        runner.row_graphs.replay_rows = rows_spy
    got, _ = _run(engine, requests)
    _assert_same(got, want)
    assert verified and all(verified), "every verify step read its drafts from the device"
    assert not graphs or (row_replays and all(row_replays)), "verify steps replayed the row graphs"
    assert engine.spec_stats.num_draft_tokens > 0
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def _verify_inputs(engine, requests, monkeypatch) -> list[tuple]:  # noqa: ANN001
    """Every verify step's (draft ids, the rows' output ids where penalties read them) in order."""
    seen = []
    verify_rows = model_runner.verify_rows

    def spy(sampler, logits, metadata, draft_ids):  # noqa: ANN001, ANN202
        outputs = None if metadata.output_token_ids is None else metadata.output_token_ids.tolist()
        seen.append((draft_ids.tolist(), outputs))
        return verify_rows(sampler, logits, metadata, draft_ids)

    monkeypatch.setattr(model_runner, "verify_rows", spy)
    _run(engine, requests)
    monkeypatch.setattr(model_runner, "verify_rows", verify_rows)
    return seen


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_verify_step_reads_what_the_host_drafts_give_it(path, heads, reference, method, monkeypatch):  # noqa: F811
    """The same workload (penalties and n > 1 among it) with host drafts and with device drafts: the
    same verify steps, each with the same draft ids and the same output ids under its penalties
    (the placeholders overwritten by the drafts on the device)."""
    requests, _, _ = reference
    runs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(EAGLE_DEVICE_DRAFTS_ENV, switch)
        engine = _engine(path, heads, method, graphs=False, async_scheduling=False)
        engine._draft_backoff.max_wait = 1  # propose (nearly) every step although random drafts fail
        runs[switch] = _verify_inputs(engine, requests, monkeypatch)
    assert runs["1"] == runs["0"]
    with_penalties = [outputs for drafts, outputs in runs["0"] if outputs is not None and max(drafts) >= 0]
    assert with_penalties, "some verify step had drafts under penalties"
    assert len(runs["0"]) >= 10


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_an_oracle_head_keeps_its_drafts_accepted_with_device_drafts(walk, method, graphs, monkeypatch):  # noqa: F811
    """Nearly every draft accepted, so the target's rows past the first really read the drafts: a draft id
    written to the wrong input row, or not at all, changes the walk or collapses the acceptance."""
    monkeypatch.setenv(EAGLE_DEVICE_DRAFTS_ENV, "1")
    target, oracle, perm = walk
    engine = _engine(target, oracle, method, graphs)
    engine.proposer.propose = lambda batch: pytest.fail("the host path proposed")  # noqa: ARG005
    assert_engine_walks(engine, perm)


def assert_engine_walks(engine, perm) -> None:  # noqa: ANN001
    """Three walks of 40 tokens on an oracle head's engine: the walk's tokens, > 95% of drafts kept."""
    starts = (3, 9, 17)
    requests = [(f"w{s}", [PERM_FIRST + s], _greedy(max_tokens=40)) for s in starts]
    got, _ = _run(engine, requests)
    for s in starts:
        assert got[f"w{s}"].outputs[0].token_ids == walk_tokens(perm, s, 40)
    stats = engine.spec_stats
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.95


def test_drafts_the_scheduler_cuts_keep_a_prefix(walk, monkeypatch):  # noqa: F811
    """A token budget of 6 for three sequences of k = 3 drafts each: the scheduler verifies fewer drafts
    than proposed (a prefix of each row); the walk is kept and most drafts still accepted."""
    monkeypatch.setenv(EAGLE_DEVICE_DRAFTS_ENV, "1")
    target, oracle, perm = walk
    engine = _engine(target, oracle, "eagle", False, max_num_batched_tokens=6)
    cut = []
    schedule = engine.scheduler.schedule

    def spy():  # noqa: ANN202
        proposed = {r.request_id: len(r.spec_token_ids) for r in engine.scheduler.running}
        out = schedule()
        cut.extend(len(s.spec_token_ids) < proposed.get(s.request_id, 0) for s in out.sequences)
        return out

    engine.scheduler.schedule = spy
    starts = (3, 9, 17)
    got, _ = _run(engine, [(f"w{s}", [PERM_FIRST + s], _greedy(max_tokens=30)) for s in starts])
    for s in starts:
        assert got[f"w{s}"].outputs[0].token_ids == walk_tokens(perm, s, 30)
    assert any(cut), "some step verified fewer drafts than proposed"
    assert engine.spec_stats.num_accepted_tokens / engine.spec_stats.num_draft_tokens > 0.9


@pytest.mark.parametrize(("switch", "on_device"), [(None, True), ("1", True), ("0", False)])
def test_drafts_stay_on_the_device_unless_the_switch_says_0(path, heads, switch, on_device, monkeypatch):  # noqa: F811
    """The default since its GPU run (bench/RESULTS.md, twelfth session): unset is on."""
    if switch is None:
        monkeypatch.delenv(EAGLE_DEVICE_DRAFTS_ENV, raising=False)
    else:
        monkeypatch.setenv(EAGLE_DEVICE_DRAFTS_ENV, switch)
    assert LLM(path, speculative_config=_spec(heads, "eagle"), **ARGS).engine._drafts_on_device is on_device


def test_the_switch_refuses_a_value_it_does_not_know(path, heads, monkeypatch):  # noqa: F811
    monkeypatch.setenv(EAGLE_DEVICE_DRAFTS_ENV, "yes")
    with pytest.raises(ValueError, match="QSERVE_EAGLE_DEVICE_DRAFTS='yes'"):
        LLM(path, speculative_config=_spec(heads, "eagle"), **ARGS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cuda_device_drafts_match_no_speculation(path, heads, walk, async_scheduling, monkeypatch):  # noqa: F811
    """On the GPU with every default graph (decode, verify rows, the head's drafting and catch-up): device
    drafts keep the greedy outputs of no speculation (float32) and every page comes back; oracle heads keep
    > 95% of their drafts (the verify step reads every draft from the device, after the drafting)."""
    monkeypatch.setenv(EAGLE_DEVICE_DRAFTS_ENV, "1")
    gpu = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=256, async_scheduling=async_scheduling)

    def make_llm(target: str, spec: dict | None) -> LLM:
        return LLM(target, speculative_config=spec, **gpu)

    _assert_cuda_heads_keep_the_outputs(path, heads, make_llm)
    _assert_oracle_heads_walk(walk, make_llm)
