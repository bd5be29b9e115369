"""Speculative decoding with the n-gram proposer on the CPU engine: greedy outputs token-identical
to decoding without it (a batch of several, batch 1, stop strings and stop tokens mid-proposal,
max_tokens, n > 1, logprobs, penalties, logit_bias, prefix caching, preemption under a tiny KV
pool, both step orders), drafts really verified and accepted on repetitive text (and fewer steps
taken), no drafts while the batch is larger than disable_by_batch_size or for structured outputs,
every page back in the pool, and the vllm:spec_decode_* series on /metrics."""

from __future__ import annotations

import json

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from qserve import LLM, SamplingParams
from qserve.structured.params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
LOOP = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # a repetitive prompt: lookup finds drafts from the start
ARGS = dict(device="cpu", dtype="float32", block_size=4)


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, **{"max_tokens": 24, "ignore_eos": True, **kwargs})


def _workload(stop_token: int, stop_text: str) -> list[tuple[str, list[int], SamplingParams]]:
    return [
        ("loop", LOOP, _greedy(max_tokens=30)),
        ("plain", list(range(40, 58)), _greedy()),
        ("prefix", list(range(40, 58)) + [3, 4], _greedy(max_tokens=13)),  # shares blocks with "plain"
        ("stop_tok", LOOP, _greedy(stop_token_ids=[stop_token])),
        ("stop_str", LOOP[2:], _greedy(stop=[stop_text])),
        ("n2", [9, 8, 7, 9, 8, 7], _greedy(n=2, max_tokens=11)),
        ("logprobs", LOOP[1:], _greedy(logprobs=2, max_tokens=17)),
        ("penalty", LOOP, _greedy(repetition_penalty=1.3, presence_penalty=0.2, min_tokens=5, max_tokens=15)),
        ("bias", [11, 12, 11, 12, 11], _greedy(logit_bias={12: 3.0}, max_tokens=14)),
        ("plp", [60, 61, 62, 60, 61, 62, 60], _greedy(prompt_logprobs=1, max_tokens=9)),  # prefills beside drafts
    ]


def _run(engine, requests) -> tuple[dict, int]:  # noqa: ANN001
    """Final outputs by request id, and the number of steps that computed something."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 1000
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    return final, steps


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for request_id, expected in want.items():
        if expected.prompt_logprobs is not None:
            assert len(got[request_id].prompt_logprobs) == len(expected.prompt_logprobs)
            for pa, pb in zip(got[request_id].prompt_logprobs[1:], expected.prompt_logprobs[1:]):
                assert list(pa) == list(pb)
                assert all(pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-4) for t in pb)
        for a, b in zip(got[request_id].outputs, expected.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
                b.token_ids,
                b.text,
                b.finish_reason,
                b.stop_reason,
            ), request_id
            if b.logprobs is not None:
                assert len(a.logprobs) == len(b.logprobs) == len(b.token_ids)
                for pa, pb in zip(a.logprobs, b.logprobs):
                    assert list(pa) == list(pb)  # the same tokens in the same order
                    for token in pb:
                        assert pa[token].logprob == pytest.approx(pb[token].logprob, abs=1e-4)
                        assert pa[token].rank == pb[token].rank
                assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


@pytest.fixture(scope="module")
def path(tiny_checkpoints) -> str:
    return tiny_checkpoints["LlamaForCausalLM"][1]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, str]:
    """Draft checkpoints of the test tokenizer: one layer, and three (deeper than the 2-layer target)."""
    from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

    return {
        f"{n}-layer": str(
            save_tiny_checkpoint(
                make_tiny_model("LlamaForCausalLM", seed=5, num_hidden_layers=n), tmp_path_factory.mktemp(f"draft{n}")
            )
        )
        for n in (1, 3)
    }


@pytest.fixture(scope="module")
def reference(path):  # noqa: ANN201
    """The workload without speculation (synchronous order, a roomy pool)."""
    llm = LLM(path, async_scheduling=False, **ARGS)
    probe = llm.generate([{"prompt_token_ids": LOOP}], _greedy(), use_tqdm=False)[0].outputs[0]
    stop_token = probe.token_ids[9]
    tokenizer = llm.get_tokenizer()
    text = tokenizer.decode(
        llm.generate([{"prompt_token_ids": LOOP[2:]}], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    )
    stop_text = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop_text.strip(), f"no visible text to stop on in {text!r}"
    requests = _workload(stop_token, stop_text)
    final, steps = _run(llm.engine, requests)
    assert final["stop_tok"].outputs[0].finish_reason == "stop" and final["stop_str"].outputs[0].finish_reason == "stop"
    return requests, final, steps


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_ngram_is_token_identical_and_accepts_drafts(path, reference, async_scheduling):
    requests, want, base_steps = reference
    llm = LLM(path, async_scheduling=async_scheduling, speculative_config=NGRAM, **ARGS)
    engine = llm.engine
    seen_spec = []
    schedule = engine.scheduler.schedule

    def spy():  # noqa: ANN202
        out = schedule()
        seen_spec.append(out.num_spec_tokens)
        return out

    engine.scheduler.schedule = spy
    got, steps = _run(engine, requests)
    _assert_same(got, want)
    stats = engine.spec_stats
    assert sum(seen_spec) == stats.num_draft_tokens > 0, "drafts were scheduled and verified"
    assert stats.num_accepted_tokens > 0, "the repetitive prompts should get drafts accepted"
    assert stats.accepted_per_pos[0] >= stats.accepted_per_pos[1] >= stats.accepted_per_pos[2]
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens <= stats.num_draft_tokens
    assert steps < base_steps, "accepted drafts save steps"
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert not engine.proposer._buffers, "finished requests' proposer state is dropped"
    # batch 1 through the offline API, and a request whose max_tokens cuts a proposal short
    single = llm.generate([{"prompt_token_ids": LOOP}], _greedy(max_tokens=7), use_tqdm=False)[0].outputs[0]
    assert single.token_ids == want["loop"].outputs[0].token_ids[:7]


@pytest.mark.parametrize(
    ("async_scheduling", "preemption_mode", "method"),
    [(False, "recompute", "ngram"), (True, "swap", "ngram"), (True, "recompute", "draft_model")],
    ids=["sync-recompute", "async-swap", "draft-model"],
)
def test_preemption_under_a_tiny_pool_keeps_the_outputs(path, reference, async_scheduling, preemption_mode, method):
    requests, want, _ = reference
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    llm = LLM(
        path,
        async_scheduling=async_scheduling,
        speculative_config=spec,
        num_kv_blocks=24,
        max_num_batched_tokens=16,
        preemption_mode=preemption_mode,
        swap_space=2**20 / 2**30,
        **ARGS,
    )
    engine = llm.engine
    engine.scheduler.watermark, engine.scheduler.watermark_per_running = 0.0, 0  # preempt, don't hold back
    got, _ = _run(engine, requests)
    _assert_same(got, want)
    assert engine.num_preemptions > 0, "the tiny pool should force preemptions"
    assert (engine.scheduler.num_swapped_out > 0) == (preemption_mode == "swap")
    assert engine.spec_stats.num_accepted_tokens > 0
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_no_drafts_above_disable_by_batch_size_nor_for_grammars(path, reference):
    requests, want, _ = reference
    llm = LLM(path, speculative_config={**NGRAM, "disable_by_batch_size": 2}, max_num_seqs=4, **ARGS)
    engine = llm.engine
    seen = []
    rows = []
    schedule = engine.scheduler.schedule

    def spy():  # noqa: ANN202
        running = engine.scheduler.num_running
        out = schedule()
        seen.append((running, out.num_spec_tokens))
        rows.append(sum(seq.sample for seq in out.sequences) + out.num_spec_tokens)
        return out

    engine.scheduler.schedule = spy
    got, _ = _run(engine, requests)
    _assert_same(got, want)
    assert all(spec == 0 for running, spec in seen if running > 2)
    assert max(rows) <= 4, "a step's logit rows stay within max_num_seqs (what the memory plan reserved)"
    seen.clear()  # alone, the same engine speculates
    alone = llm.generate([{"prompt_token_ids": LOOP}], _greedy(max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == want["loop"].outputs[0].token_ids and any(spec for _, spec in seen)
    # a structured-output request gets no drafts (its grammar would have to check them first)
    seen.clear()
    choice = SamplingParams(
        temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(choice=["ab ab ab ab"])
    )
    out = llm.generate(["ab ab ab"], choice, use_tqdm=False)[0].outputs[0]
    assert out.text == "ab ab ab ab" and not any(spec for _, spec in seen)


def test_no_drafts_while_a_burst_is_still_being_admitted(path):
    """``disable_by_batch_size`` counts the waiting requests too (vLLM's enqueued requests): a burst
    that the token budget admits over several steps gets no drafts while the running and waiting
    together exceed 2, even in steps where 2 or fewer run (before: those speculated, so a busy
    engine's first steps carried eager verify and draft work); once they are few, it does."""
    prompts = [(LOOP * 2)[i:] + (LOOP * 2)[:i] for i in range(4)]  # 20 tokens each, 8 a step: in turn
    params = [_greedy(max_tokens=n) for n in (6, 8, 30, 30)]  # the last two run on alone
    # the target as its own draft: it proposes at every chance it gets (n-gram needs a match first)
    self_draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    want = LLM(path, **ARGS).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = LLM(
        path, speculative_config=self_draft, max_num_batched_tokens=8, max_num_seqs=8, **ARGS
    )  # fmt: skip
    engine = llm.engine
    seen = []
    schedule = engine.scheduler.schedule

    def spy():  # noqa: ANN202
        enqueued = (engine.scheduler.num_running, engine.scheduler.num_waiting)
        out = schedule()
        seen.append((*enqueued, out.num_spec_tokens))
        return out

    engine.scheduler.schedule = spy
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert any(running <= 2 < running + waiting for running, waiting, _ in seen), seen
    assert all(spec == 0 for running, waiting, spec in seen if running + waiting > 2), seen
    assert any(spec for *_, spec in seen), "speculation came back once the burst was down to 2"


def test_seeded_sampling_is_reproducible_and_metrics_are_exported(path):
    from qserve.engine.async_engine import AsyncEngine
    from qserve.server.metrics import ServerMetrics

    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True, logprobs=1)
    llm = LLM(path, speculative_config=NGRAM, **ARGS)
    runs = [llm.generate([{"prompt_token_ids": LOOP}] * 2, params, use_tqdm=False) for _ in range(2)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
    assert all(len(o.outputs[0].token_ids) == len(o.outputs[0].logprobs) == 20 for o in runs[1])
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    # embedding requests share the engine (their one step never gets drafts)
    plain = LLM(path, **ARGS).embed([{"prompt_token_ids": LOOP}], use_tqdm=False)[0].outputs.embedding
    embedded = llm.embed([{"prompt_token_ids": LOOP}], use_tqdm=False)[0].outputs.embedding
    assert embedded == pytest.approx(plain, abs=1e-5)
    metrics = ServerMetrics(lambda: AsyncEngine({"tiny": llm.engine}))
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name.startswith("vllm:spec_decode")
    }
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == stats.num_drafts
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == stats.num_draft_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == stats.num_accepted_tokens
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(3)]
    assert per_pos == stats.accepted_per_pos


@pytest.mark.parametrize(
    ("async_scheduling", "draft"), [(False, "self"), pytest.param(True, "1-layer", marks=pytest.mark.slow)]
)
def test_draft_model_in_the_same_pool_is_token_identical(path, drafts, reference, async_scheduling, draft):
    """The target as its own draft keeps (nearly) every draft; an unrelated one-layer draft keeps
    what it keeps; both give the outputs of no speculation, and every page (the draft's too)
    comes back to the pool."""
    requests, want, base_steps = reference
    spec = {"method": "draft_model", "model": path if draft == "self" else drafts[draft], "num_speculative_tokens": 3}
    engine = LLM(path, async_scheduling=async_scheduling, speculative_config=spec, **ARGS).engine
    got, steps = _run(engine, requests)
    _assert_same(got, want)
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0
    if draft == "self":  # the draft's argmax is the target's (same weights, same logit processing)
        assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.9 and steps < base_steps
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert not engine.proposer._mirrors


def test_a_stop_inside_a_steps_tokens_discards_the_rest(path):
    """With the target as its own draft nearly every draft is kept, so steps emit several tokens; a
    stop token first met inside one (not its last token) ends the output there, as without
    speculation, and the step's later tokens are discarded."""
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    llm = LLM(path, speculative_config=spec, **ARGS)
    steps = []  # (index of the step's first token in the output, the tokens it emitted)
    emit = llm.engine._emit_verified

    def spy(sequence, tokens, token_logprobs):  # noqa: ANN001, ANN202
        steps.append((len(sequence.request.output_token_ids) - len(tokens), list(tokens)))
        return emit(sequence, tokens, token_logprobs)

    llm.engine._emit_verified = spy
    free_run = (
        llm.generate([{"prompt_token_ids": LOOP}], _greedy(max_tokens=30), use_tqdm=False)[0].outputs[0].token_ids
    )
    inside = {start + j for start, tokens in steps for j in range(len(tokens) - 1)}  # a later token followed
    at = next(i for i in sorted(inside) if free_run[i] not in free_run[:i])
    stop = free_run[at]
    steps.clear()
    params = _greedy(max_tokens=30, stop_token_ids=[stop])
    got = llm.generate([{"prompt_token_ids": LOOP}], params, use_tqdm=False)[0].outputs[0]
    want = LLM(path, **ARGS).generate([{"prompt_token_ids": LOOP}], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids == free_run[: at + 1] and got.finish_reason == want.finish_reason == "stop"
    start, tokens = steps[-1]
    assert start <= at < start + len(tokens) - 1, "the stop came before the end of its step's tokens"


def test_the_draft_models_weights_count_in_the_memory_plan(path):
    plain = LLM(path, gpu_memory_budget="256MiB", **ARGS).engine.memory_plan
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    with_draft = LLM(path, gpu_memory_budget="256MiB", speculative_config=spec, **ARGS).engine.memory_plan
    assert with_draft.weights_bytes == 2 * plain.weights_bytes  # the target is its own draft here
    assert with_draft.num_kv_blocks < plain.num_kv_blocks
    # its KV indexed by the target's blocks: a page twice the bytes (the same model), and its scratch
    assert with_draft.shadow_kv_bytes_per_token == plain.kv_bytes_per_token
    assert with_draft.shadow_scratch_bytes == 256 * 1 * ARGS["block_size"] * plain.kv_bytes_per_token
    left = with_draft.budget_bytes - with_draft.weights_bytes - with_draft.activation_bytes
    left -= with_draft.overhead_bytes + with_draft.shadow_scratch_bytes
    assert with_draft.num_kv_blocks == left // (2 * plain.kv_bytes_per_token * ARGS["block_size"])


def test_plan_counts_the_draft_model(path, drafts, capsys):
    import argparse

    from qserve.commands import plan

    parser = argparse.ArgumentParser()
    plan.register(parser)
    results = []
    for extra in (
        [],
        ["--speculative-config", json.dumps({"method": "draft_model", "model": path, "num_speculative_tokens": 2})],
    ):
        assert plan.run(parser.parse_args([path, "--gpu-memory-budget", "256MiB", "--json", *extra])) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[1]["draft_weights_bytes"] > 0
    assert results[1]["weights_bytes"] == results[0]["weights_bytes"] + results[1]["draft_weights_bytes"]
    # its KV indexed by the target's blocks: each page larger by the draft's KV per token (the
    # target as its own draft: twice the bytes, so about half the pages), plus its scratch blocks
    plain, spec = results
    assert spec["shadow_kv_bytes_per_token"] == plain["kv_bytes_per_token"] and plain["shadow_kv_bytes_per_token"] == 0
    assert spec["shadow_scratch_bytes"] == 256 * 16 * spec["shadow_kv_bytes_per_token"]  # cdiv(2, 16) a sequence
    left = spec["budget_bytes"] - spec["weights_bytes"] - spec["activation_bytes"] - spec["overhead_bytes"]
    per_page = 2 * plain["kv_bytes_per_token"] * 16
    assert spec["num_kv_blocks"] == (left - spec["shadow_scratch_bytes"]) // per_page


def test_a_draft_deeper_than_the_target_has_its_own_kv(path, drafts, reference):
    """The draft's KV is a cache of its own indexed by the target's blocks: a 3-layer draft of the
    2-layer target runs (its layers could not view the target's), the outputs are those of no
    speculation, and every page in use is the target's at every step."""
    requests, want, _ = reference
    spec = {"method": "draft_model", "model": drafts["3-layer"], "num_speculative_tokens": 3}
    engine = LLM(path, speculative_config=spec, **ARGS).engine
    assert len(engine.proposer.shadow.kv_caches) == 3
    for request_id, prompt, params in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    got, pool = {}, engine.block_pool
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                got[output.request_id] = output
        assert pool.num_used_blocks == len({b for t in engine.kv_manager._tables.values() for b in t})
    _assert_same(got, want)
    assert engine.spec_stats.num_draft_tokens > 0
    assert pool.num_free_blocks == pool.num_blocks and not engine.proposer.shadow._lent


def test_bad_config_is_refused_naming_the_field(path, drafts):
    with pytest.raises(ValueError, match=r"speculative_config\.model is required"):
        LLM(path, speculative_config={"method": "draft_model", "num_speculative_tokens": 2}, **ARGS)
    with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens"):
        LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": -1}, **ARGS)
    with pytest.raises(ValueError, match="tensor parallelism"):
        LLM(path, speculative_config=NGRAM, tensor_parallel_size=2, **ARGS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cuda_greedy_ngram_is_token_identical(path, async_scheduling):
    """On the GPU (Triton attention with several query rows per sequence, the eager verify step
    between graph-replayed plain decodes, pinned copies, a draft model's KV aliasing the target's
    pages): the workload's greedy outputs and logprobs equal those without speculation, for n-gram
    and draft-model proposals, in float32 (numerics identical enough for argmax)."""
    finals = []
    for spec in (None, NGRAM, {"method": "draft_model", "model": path, "num_speculative_tokens": 3}):
        # A fixed small pool: the first engine's default pool would take the second's memory.
        llm = LLM(
            path,
            device="cuda",
            dtype="float32",
            block_size=16,
            num_kv_blocks=256,
            async_scheduling=async_scheduling,
            speculative_config=spec,
        )
        probe = llm.generate([{"prompt_token_ids": LOOP}], _greedy(), use_tqdm=False)[0].outputs[0]
        requests = [r for r in _workload(probe.token_ids[9], "\n\n") if r[0] != "stop_str"]
        finals.append(_run(llm.engine, requests)[0])
        if spec is not None:
            stats = llm.engine.spec_stats
            assert stats.num_accepted_tokens > 0
            if spec["method"] == "draft_model":  # its own draft: the aliased KV views read right on the GPU
                assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.9
            assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks
        del llm
        torch.cuda.empty_cache()
    _assert_same(finals[1], finals[0])
    _assert_same(finals[2], finals[0])


def test_serve_and_generate_take_the_flag(path, tmp_path, capsys):
    import argparse

    from qserve.commands import generate, serve

    parser = argparse.ArgumentParser()
    serve.register(parser)
    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens"):
        serve.build_host_factory(parser.parse_args([str(tmp_path), "--speculative-config", bad]))
    args = parser.parse_args([str(tmp_path), "--speculative-config", json.dumps(NGRAM), "--tensor-parallel-size", "2"])
    with pytest.raises(ValueError, match="--speculative-config"):
        serve.build_host_factory(args)
    draft = json.dumps({"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    args = parser.parse_args([f"a={tmp_path}", f"b={tmp_path}", "--speculative-config", draft])
    with pytest.raises(ValueError, match="a draft model serves one model"):
        serve.build_host_factory(args)

    parser = argparse.ArgumentParser()
    generate.register(parser)
    texts = []
    for extra in ([], ["--speculative-config", json.dumps(NGRAM)]):
        args = parser.parse_args([path, "--prompt", "ab ab ab ab", "--max-tokens", "12", "--device", "cpu", *extra])
        assert generate.run(args) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()


def test_a_finished_sample_of_n_gives_back_its_draft_state_at_once(path):  # noqa: F811
    """n=2: one sample stops early while its sibling runs on. The draft model's scratch blocks and
    mirror of the finished sample go back when it finishes, not when the whole group does: they were
    held until then, so a finished sample's blocks were missing from the scratch pool, sized for the
    running sequences only (later sequences found it spent and got no drafts)."""
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    params = SamplingParams(n=2, temperature=0.7, seed=3, max_tokens=20, ignore_eos=True)
    prompt = {"prompt_token_ids": LOOP}
    probe = LLM(path, async_scheduling=False, speculative_config=spec, **ARGS)
    first, second = (o.token_ids for o in probe.generate([prompt], params, use_tqdm=False)[0].outputs)
    # a token that ends the first sample after a few proposals and the second later (or never)
    stop = next(t for i, t in enumerate(first) if i >= 4 and t not in first[:i] + second[: i + 4])
    llm = LLM(path, async_scheduling=False, speculative_config=spec, **ARGS)
    engine = llm.engine
    engine.add_request("g", prompt, params.clone(stop_token_ids=[stop]))
    shadow, proposer = engine.proposer.shadow, engine.proposer
    total = len(shadow._scratch)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        group = engine._groups.get("g")
        finished = [] if group is None else [s.request.request_id for s in group.sequences if s.finish_reason]
        if not finished:
            continue
        assert len(finished) == 1, "the samples should finish apart"
        assert finished[0] not in proposer._mirrors and finished[0] not in proposer._held
        held = sum(len(blocks) for blocks in proposer._held.values())
        assert len(shadow._scratch) + held == total
        checked += 1
    assert checked > 0, "no step ran with one sample finished and the other running"
    assert len(shadow._scratch) == total and not proposer._held and not proposer._mirrors
