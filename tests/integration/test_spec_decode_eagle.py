"""EAGLE / EAGLE-3 heads (vLLM's checkpoint layout) on the CPU engine, and adaptive speculation.

Random heads: greedy outputs token-identical to no speculation over the mixed workload of
test_spec_decode (batch of several, batch 1, stops, logprobs, n > 1, ...), both step orders, under
preemption (recompute and swap), and while ``disable_by_batch_size`` switches speculation on and off
(the head fills what it missed); each proposal equals the drafts of a dense PyTorch reading of the
head over the target's hidden states from transformers (so the hidden-state plumbing, the shift by
one, EAGLE-3's taps, d2t and the head's KV are checked, not only the rejection sampler). Oracle
heads on a permutation target: nearly every draft accepted, and almost none once the hidden states
reach the head one position off. Adaptive verification: outputs unchanged, k chosen by the policy.
With ``QSERVE_SPEC_GRAPHS=1`` (StaticReplay stand-ins on CPU, captured graphs under ``-m gpu``) verify
steps replay the row graphs, which return the heads' hidden states: the same outputs, the same hidden
states step by step as the eager engine, the oracle heads' acceptance kept.

These tests read every proposal's drafts on the host (the proposer's ``propose``), so they run with
``QSERVE_EAGLE_DEVICE_DRAFTS=0``; test_spec_decode_device_drafts checks that the default device path
gives each verify step the same drafts and inputs as this one, and keeps the same outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qserve import LLM
from qserve.runner.cuda_graphs import DEFAULT_BUCKETS
from tests.helpers.eagle_heads import (
    PERM_FIRST,
    oracle_head,
    permutation,
    permutation_target,
    random_head,
    walk_tokens,
)
from tests.integration.test_spec_decode import (  # noqa: F401 - path, reference: fixtures
    ARGS,
    LOOP,
    NGRAM,
    _assert_same,
    _greedy,
    _run,
    _workload,
    path,
    reference,
)

K = 3


@pytest.fixture(autouse=True)
def host_drafts(monkeypatch) -> None:
    """Proposals through the host path, whose drafts these tests read (module doc)."""
    from qserve.engine.engine import EAGLE_DEVICE_DRAFTS_ENV

    monkeypatch.setenv(EAGLE_DEVICE_DRAFTS_ENV, "0")


@pytest.fixture(scope="module")
def heads(path, tmp_path_factory) -> dict[str, str]:  # noqa: F811
    """Random heads for the tiny target: EAGLE, and EAGLE-3 with a draft vocabulary of 128 ids
    (its taps given in config.json: the target has 2 layers, vLLM's default needs more)."""
    target = json.loads((Path(path) / "config.json").read_text())
    return {
        "eagle": str(random_head(tmp_path_factory.mktemp("eagle"), target, "eagle", seed=2)),
        "eagle3": str(
            random_head(
                tmp_path_factory.mktemp("eagle3"),
                target,
                "eagle3",
                seed=3,
                draft_vocab_size=128,
                eagle_aux_hidden_state_layer_ids=[1, 0, 1],
            )
        ),
    }


def _spec(heads: dict[str, str], method: str, **extra) -> dict:
    return {"method": method, "model": heads[method], "num_speculative_tokens": K, **extra}


def _assert_oracle_heads_walk(walk, make_llm, after=None) -> None:  # noqa: ANN001
    """On the GPU: oracle heads (EAGLE and EAGLE-3) of the walk target, each engine from
    ``make_llm(target, speculative_config)``, give the walk's tokens and keep > 95% of their drafts
    (which collapses when the heads get no or misplaced hidden states); ``after(llm)`` checks more
    once the prompts are done."""
    target, oracle, perm = walk
    for method in ("eagle", "eagle3"):
        llm = make_llm(target, _spec(oracle, method))
        prompts = [{"prompt_token_ids": [PERM_FIRST + s]} for s in (3, 9, 17)]
        outputs = llm.generate(prompts, _greedy(max_tokens=40), use_tqdm=False)
        for s, output in zip((3, 9, 17), outputs):
            assert output.outputs[0].token_ids == walk_tokens(perm, s, 40)
        if after is not None:
            after(llm)
        stats = llm.engine.spec_stats
        assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.95
        del llm
        torch.cuda.empty_cache()


def _assert_cuda_heads_keep_the_outputs(target, heads, make_llm, check=None) -> None:  # noqa: ANN001
    """On the GPU: the workload (less its stop string) without speculation and with the random EAGLE and
    EAGLE-3 heads of ``target``, each engine from ``make_llm(target, speculative_config)``: the same outputs,
    drafts verified, every page back; ``check(llm)`` checks more of each speculating engine."""
    finals = {}
    for name in ("none", "eagle", "eagle3"):
        llm = make_llm(target, None if name == "none" else _spec(heads, name))
        probe = llm.generate([{"prompt_token_ids": LOOP}], _greedy(), use_tqdm=False)[0].outputs[0]
        requests = [r for r in _workload(probe.token_ids[9], "\n\n") if r[0] != "stop_str"]
        finals[name] = _run(llm.engine, requests)[0]
        if name != "none":
            assert llm.engine.spec_stats.num_draft_tokens > 0
            assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks
            if check is not None:
                check(llm)
        del llm
        torch.cuda.empty_cache()
    _assert_same(finals["eagle"], finals["none"])
    _assert_same(finals["eagle3"], finals["none"])


# ----------------------------------------------------------------------------------------------
# A dense reading of the head (plain PyTorch over the checkpoint's tensors), the drafts' oracle
# ----------------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:  # [T, heads, D], positions 0..T-1, NeoX halves
    d = x.shape[-1]
    angles = torch.arange(x.shape[0]).double()[:, None] / theta ** (torch.arange(0, d, 2).double() / d)  # [T, D/2]
    cos, sin = angles.cos().float()[:, None], angles.sin().float()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _layer(t: dict, p: str, cfg: dict, attn_in: torch.Tensor, residual: torch.Tensor) -> tuple:
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg["hidden_size"] // heads
    n = attn_in.shape[0]
    q = _rope((attn_in @ t[f"{p}.self_attn.q_proj.weight"].T).view(n, heads, dim), cfg.get("rope_theta", 1e4))
    k = _rope((attn_in @ t[f"{p}.self_attn.k_proj.weight"].T).view(n, kv_heads, dim), cfg.get("rope_theta", 1e4))
    v = (attn_in @ t[f"{p}.self_attn.v_proj.weight"].T).view(n, kv_heads, dim)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / dim**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * dim)
    stream = out @ t[f"{p}.self_attn.o_proj.weight"].T + residual
    normed = _rms(stream, t[f"{p}.post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    gate, up = normed @ t[f"{p}.mlp.gate_proj.weight"].T, normed @ t[f"{p}.mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ t[f"{p}.mlp.down_proj.weight"].T, stream


def _dense_head(t: dict, cfg: dict, method: str, target, ids: list[int], features: torch.Tensor) -> tuple:
    """(logits [T, V_target], next features [T, H]) of the head over rows (ids[i], features[i])
    at positions 0..T-1, with causal attention among them."""
    eps = cfg["rms_norm_eps"]
    embeds = target.model.embed_tokens.weight[torch.tensor(ids)]
    if method == "eagle":
        x = torch.cat([embeds, features], -1) @ t["fc.weight"].T
        mlp_out, stream = _layer(t, "layers.0", cfg, x, x)
        out = mlp_out + stream
        return target.lm_head(out), out
    if cfg.get("norm_before_residual"):
        residual = hidden = _rms(features, t["midlayer.hidden_norm.weight"], eps)
    else:
        residual, hidden = features, _rms(features, t["midlayer.hidden_norm.weight"], eps)
    attn_in = torch.cat([_rms(embeds, t["midlayer.input_layernorm.weight"], eps), hidden], -1)
    mlp_out, stream = _layer(t, "midlayer", cfg, attn_in, residual)
    prenorm = mlp_out + stream
    draft_logits = _rms(prenorm, t["norm.weight"], eps) @ t["lm_head.weight"].T  # [T, draft_vocab]
    target_ids = torch.arange(draft_logits.shape[-1]) + t["d2t"]
    logits = torch.full((len(ids), cfg["vocab_size"]), float("-inf"))
    logits[:, target_ids] = draft_logits
    return logits, prenorm


def _reference_drafts(head_path: str, method: str, target, tokens: list[int], k: int) -> list[int]:
    """k drafts for a sequence of known ``tokens``, recomputed from scratch: the target's hidden
    states (transformers) of positions 0..L-2, the head over them, then k steps of its own."""
    t = load_file(str(Path(head_path) / "model.safetensors"))
    t = {name.removeprefix("model."): v.float() if v.is_floating_point() else v for name, v in t.items()}
    cfg = json.loads((Path(head_path) / "config.json").read_text())
    with torch.no_grad():
        out = target(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        if method == "eagle":
            features = out.hidden_states[-1][0]  # the final (normed) hidden states
        else:
            taps = cfg["eagle_aux_hidden_state_layer_ids"]
            features = torch.cat([out.hidden_states[i][0] for i in taps], -1) @ t["fc.weight"].T
        ids, drafts = list(tokens[1:]), []
        for _ in range(k):
            logits, feature_out = _dense_head(t, cfg, method, target, ids, features)
            drafts.append(int(logits[-1].argmax()))
            ids.append(drafts[-1])
            features = torch.cat([features, feature_out[-1:]])
    return drafts


# ----------------------------------------------------------------------------------------------
# Random heads: token identity, and the drafts themselves against the dense reading
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_eagle_is_token_identical(path, heads, reference, method, async_scheduling):  # noqa: F811
    requests, want, _ = reference
    llm = LLM(path, async_scheduling=async_scheduling, speculative_config=_spec(heads, method), **ARGS)
    engine = llm.engine
    got, _ = _run(engine, requests)
    _assert_same(got, want)
    assert engine.spec_stats.num_draft_tokens > 0, "drafts were proposed and verified"
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks, "the head's pages came back too"
    assert not engine.proposer._mirrors and not engine.proposer._last
    single = llm.generate([{"prompt_token_ids": LOOP}], _greedy(max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert single.token_ids == want["loop"].outputs[0].token_ids  # batch 1


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_equal_a_dense_reading_of_the_head(tiny_checkpoints, path, heads, method):  # noqa: F811
    """Every proposal (batch of three, chunked prompts, verify steps with rejections) is what the
    head computes from scratch over the target's hidden states of the sequence's known tokens."""
    target = tiny_checkpoints["LlamaForCausalLM"][0]
    llm = LLM(path, speculative_config=_spec(heads, method), max_num_batched_tokens=8, **ARGS)
    engine = llm.engine
    engine._draft_backoff.max_wait = 1  # propose (nearly) every step although random drafts fail
    seen, lent, scratch_used = [], [], []  # scratch_used: (index of the batch's first in seen, lent any)
    propose = engine.proposer.propose
    shadow = engine.proposer.shadow
    draft_table = shadow.draft_table

    def lend(request_id, end):  # noqa: ANN001, ANN202
        table = draft_table(request_id, end)
        lent.extend(b for b in table if b >= engine.block_pool.num_blocks)
        return table

    def spy(batch):  # noqa: ANN001, ANN202
        before = len(lent)
        result = propose(batch)
        scratch_used.append((len(seen), len(lent) > before))
        seen.extend(
            ([*item.prompt_token_ids, *item.output_token_ids], item.max_num_tokens, drafts)
            for item, drafts in zip(batch, result)
        )
        return result

    engine.proposer.propose = spy
    shadow.draft_table = lend
    prompts = [{"prompt_token_ids": LOOP}, {"prompt_token_ids": list(range(40, 58))}, {"prompt_token_ids": [9, 8, 7]}]
    llm.generate(prompts, _greedy(max_tokens=12), use_tqdm=False)
    assert len(seen) >= 8 and all(len(drafts) == k for _, k, drafts in seen)
    # the proposals checked below drafted over scratch blocks too (positions past the target's table)
    assert any(used for first, used in scratch_used if first < 12)
    for tokens, k, drafts in seen[:12]:
        assert drafts == _reference_drafts(heads[method], method, target, tokens, k), tokens


def test_preemption_and_disable_by_batch_size_keep_the_outputs(path, heads, reference):  # noqa: F811
    """Recompute and swap under a tiny pool (a swapped-in sequence's head starts from a gap), and a
    batch crossing disable_by_batch_size (plain decode steps then carry no hidden states): the
    outputs are those of no speculation and every page comes back."""
    requests, want, _ = reference
    for method, extra in (
        ("eagle", dict(preemption_mode="recompute")),
        ("eagle3", dict(preemption_mode="swap", swap_space=2**20 / 2**30, async_scheduling=True)),
    ):
        llm = LLM(
            path, speculative_config=_spec(heads, method), num_kv_blocks=24, max_num_batched_tokens=16, **extra, **ARGS
        )
        engine = llm.engine
        engine.scheduler.watermark, engine.scheduler.watermark_per_running = 0.0, 0
        got, _ = _run(engine, requests)
        _assert_same(got, want)
        assert engine.num_preemptions > 0
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    llm = LLM(path, speculative_config=_spec(heads, "eagle", disable_by_batch_size=3), **ARGS)
    engine = llm.engine
    captured = []
    launch = engine.runner.launch

    def spy(scheduler_output, previous=None):  # noqa: ANN001, ANN202
        captured.append((scheduler_output.spec_hidden_states, scheduler_output.num_spec_tokens))
        return launch(scheduler_output, previous)

    engine.runner.launch = spy
    got, _ = _run(engine, requests)
    _assert_same(got, want)
    assert (False, 0) in captured, "busy plain decode steps carry no hidden states"
    assert any(spec for _, spec in captured), "speculation came back once the batch shrank"


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_the_heads_kv_lives_at_the_targets_slots(path, heads, reference, method):  # noqa: F811
    """The head's KV cache is indexed by the target's blocks (qserve.spec_decode.shadow_kv): no page
    of the pool is ever the head's, and a speculating sequence holds only the target's pages. The
    positions it drafts from past the last known token are NOT yet in the target's table when the
    proposal runs (the scheduler allocates the verify step's slots after ``propose`` returns): they
    take scratch blocks (never a target block id, distinct between sequences); those inside the
    target's table are in its last, partly computed block, which no other sequence holds."""
    requests, want, _ = reference
    engine = LLM(path, speculative_config=_spec(heads, method), **ARGS).engine
    shadow, pool = engine.proposer.shadow, engine.block_pool
    num_target = pool.num_blocks
    assert num_target == engine.kv_manager.pool.num_blocks
    for key, value in shadow.kv_caches:
        assert key.shape[0] == value.shape[0] == num_target + engine.config.max_num_seqs  # k - 1 <= block_size
        assert key.data_ptr() not in {k.data_ptr() for k, _ in engine.runner.kv_caches}
    draft_table = shadow.draft_table
    lent, past_target = [], []

    def spy(request_id, end):  # noqa: ANN001, ANN202
        target = list(engine.kv_manager.block_table(request_id))
        table = draft_table(request_id, end)
        assert table is not None and table[: len(target)] == target
        extra = table[len(target) :]
        assert all(b >= num_target for b in extra) and not set(extra) & set(lent)
        lent.extend(extra)
        past_target.append(end > len(target) * ARGS["block_size"])
        last = end - (K - 1)  # the last known token: not computed by the target yet
        if last // ARGS["block_size"] < len(target):
            assert pool.ref_count(target[last // ARGS["block_size"]]) == 1, "its partly computed block is its own"
        return table

    shadow.draft_table = spy
    for request_id, prompt, params in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    got, steps, proposals = {}, 0, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 1000
        lent.clear()
        for output in engine.step():
            if output.finished:
                got[output.request_id] = output
        # every page in use is the target's: the head holds none
        assert pool.num_used_blocks == len({b for t in engine.kv_manager._tables.values() for b in t})
        assert pool.num_used_by(f"{engine.owner}:eagle") == 0
        for request in engine.scheduler.running:  # no page past the tokens (and the drafts) it needs
            table = engine.kv_manager.block_table(request.request_id)
            assert len(table) <= -(-(request.num_tokens + K) // ARGS["block_size"])
        proposals += len(past_target)
    _assert_same(got, want)
    assert engine.spec_stats.num_draft_tokens > 0 and proposals > 0
    assert any(past_target), "some drafted positions lay past the target's table: scratch blocks were needed"
    assert sorted(shadow._scratch) == list(range(num_target, num_target + engine.config.max_num_seqs))
    assert not shadow._lent, "every scratch block came back"


def test_an_eagle_pool_holds_about_the_tokens_of_no_speculation(path, heads):  # noqa: F811
    """Under one budget the EAGLE engine's pool has fewer pages only by the head's byte share (its
    layers' KV per token over the target's plus the head's, and its scratch blocks); with the head's
    pages in the pool, as before, a speculating sequence held about twice the pages."""
    budget = dict(gpu_memory_budget="256MiB", **ARGS)
    plain = LLM(path, **budget).engine.memory_plan
    engine = LLM(path, speculative_config=_spec(heads, "eagle"), **budget).engine
    plan, head = engine.memory_plan, engine._eagle_head.config.model
    per_head = 2 * head.num_layers * head.num_kv_heads * head.head_dim * 4  # float32
    assert plan.shadow_kv_bytes_per_token == per_head and plan.kv_bytes_per_token == plain.kv_bytes_per_token
    scratch = engine.config.max_num_seqs * 1  # cdiv(K - 1, block_size) blocks per sequence
    assert plan.shadow_scratch_bytes == scratch * ARGS["block_size"] * per_head
    left = plan.budget_bytes - plan.weights_bytes - plan.activation_bytes - plan.overhead_bytes
    left -= plan.shadow_scratch_bytes
    assert plan.num_kv_blocks == left // ((plain.kv_bytes_per_token + per_head) * ARGS["block_size"])
    assert engine.block_pool.num_blocks == plan.num_kv_blocks
    share = plain.kv_bytes_per_token / (plain.kv_bytes_per_token + per_head)  # 2 layers of 3 here
    head_weights = plan.weights_bytes - plain.weights_bytes
    room = (head_weights + plan.shadow_scratch_bytes) / ((plain.kv_bytes_per_token + per_head) * ARGS["block_size"])
    assert plain.num_kv_blocks * share - room - 2 <= plan.num_kv_blocks <= plain.num_kv_blocks * share
    # a speculating sequence holds the pages of its tokens (and its drafts), no more
    llm = LLM(path, speculative_config=_spec(heads, "eagle"), **ARGS)
    llm.engine.add_request("loop", {"prompt_token_ids": LOOP}, _greedy(max_tokens=30))
    used = []
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        for request in llm.engine.scheduler.running:
            used.append((llm.engine.block_pool.num_used_blocks, request.num_tokens))
    assert llm.engine.spec_stats.num_draft_tokens > 0
    assert all(blocks <= -(-(tokens + K) // ARGS["block_size"]) for blocks, tokens in used)


# ----------------------------------------------------------------------------------------------
# Oracle heads: acceptance, and its collapse when the hidden states are one position off
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def walk(tmp_path_factory) -> tuple[str, dict[str, str], list[int]]:
    perm = permutation()
    target, config = permutation_target(tmp_path_factory.mktemp("walk-target"), perm)
    heads = {
        "eagle": str(oracle_head(tmp_path_factory.mktemp("oracle1"), config, "eagle", perm)),
        "eagle3": str(oracle_head(tmp_path_factory.mktemp("oracle3"), config, "eagle3", perm, draft_vocab_size=96)),
    }
    return str(target), heads, perm


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_oracle_head_gets_its_drafts_accepted(walk, method):
    """EAGLE-3 here reads vLLM's default taps (2, 2, 1) of the 4-layer target."""
    target, heads, perm = walk
    prompts = [{"prompt_token_ids": [PERM_FIRST + s for s in (3, 9, 17, 40)]}, {"prompt_token_ids": [PERM_FIRST + 5]}]
    params = _greedy(max_tokens=30)
    expected = walk_tokens(perm, 40, 30)

    def acceptance(shift: bool) -> float:
        llm = LLM(target, speculative_config=_spec(heads, method), **ARGS)
        engine = llm.engine
        if shift:  # the plumbing one position off: each position gets its predecessor's states
            observe = engine.proposer.observe
            engine.proposer.observe = lambda rows, hidden: observe(rows, torch.roll(hidden, 1, 0))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert outputs[0].outputs[0].token_ids == expected
        stats = engine.spec_stats
        return stats.num_accepted_tokens / stats.num_draft_tokens

    assert acceptance(shift=False) > 0.95
    assert acceptance(shift=True) < 0.1


# ----------------------------------------------------------------------------------------------
# Adaptive verification
# ----------------------------------------------------------------------------------------------


def _spy_policy(engine) -> list[tuple[int, int, int]]:  # noqa: ANN001
    """(running sequences, the policy's k, the most drafts a sequence got) at each proposal."""
    policy, chosen = engine.adaptive_speculation, []
    propose = engine._propose_drafts

    def spy():  # noqa: ANN202
        k = policy.num_tokens(engine.scheduler.num_running)
        propose()
        drafts = [len(r.spec_token_ids) for r in engine.scheduler.running]
        chosen.append((engine.scheduler.num_running, k, max(drafts, default=0)))

    engine._propose_drafts = spy
    return chosen


def test_adaptive_verification_keeps_the_outputs_and_follows_the_policy(path, reference):  # noqa: F811
    """n-gram drafts on the mixed workload with a costly row: k per step is the policy's for the
    batch, a busy batch with middling acceptance decodes plainly, and the outputs are those of no
    speculation."""
    requests, want, _ = reference
    spec = {**NGRAM, "enable_adaptive_verification": True, "adaptive_verification_row_cost": 0.5}
    engine = LLM(path, speculative_config=spec, **ARGS).engine
    policy = engine.adaptive_speculation
    assert policy is not None and policy.row_cost == 0.5 and policy.draft_cost == 0.0
    chosen = _spy_policy(engine)
    got, _ = _run(engine, requests)
    _assert_same(got, want)
    assert all(most <= k for _, k, most in chosen), "no sequence gets more drafts than the policy's k"
    assert any(k == 0 for running, k, _ in chosen if running > 4), "a busy batch decodes plainly"
    assert any(k > 0 for _, k, _ in chosen) and engine.spec_stats.num_accepted_tokens > 0
    assert policy.rates != [policy.prior] * K, "the estimates follow what was measured"


def test_adaptive_verification_with_an_eagle_head(walk):
    """An oracle head (drafts always kept) whose forwards cost a third of the target's: with a row
    cost of 0.5 speculation pays only below 4 sequences (1 + 0.5 B < 1 / draft_cost), so the
    policy turns it on as the batch drains, at full k once measured; outputs unchanged."""
    target, heads, perm = walk
    spec = {**_spec(heads, "eagle"), "enable_adaptive_verification": True, "adaptive_verification_row_cost": 0.5}
    llm = LLM(target, speculative_config=spec, **ARGS)
    engine = llm.engine
    assert 0.2 < engine.adaptive_speculation.draft_cost < 0.5
    chosen = _spy_policy(engine)
    starts = [3, 9, 17, 40, 50, 60]
    lengths = [8, 12, 16, 20, 28, 40]
    prompts = [{"prompt_token_ids": [PERM_FIRST + s]} for s in starts]
    outputs = llm.generate(prompts, [_greedy(max_tokens=n) for n in lengths], use_tqdm=False)
    for start, n, output in zip(starts, lengths, outputs):
        assert output.outputs[0].token_ids == walk_tokens(perm, start, n)
    assert all(k == 0 for running, k, _ in chosen if running >= 4)
    assert any(k == K for running, k, _ in chosen if running == 1), "full k once acceptance is measured"
    stats = engine.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cuda_eagle_heads(path, heads, walk, async_scheduling):  # noqa: F811
    """On the GPU (Triton attention over the head's shadow cache at the target's block ids, captured steps
    run eagerly between graph-replayed plain decodes, the head's catch-up enqueued behind a step
    in flight): random heads keep the workload's greedy outputs, oracle heads get their drafts
    accepted, and every page comes back; float32 so argmax is not decided by rounding."""
    gpu = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=256, async_scheduling=async_scheduling)
    finals = []
    for spec in (None, _spec(heads, "eagle"), _spec(heads, "eagle3", disable_by_batch_size=4)):
        llm = LLM(path, speculative_config=spec, **gpu)
        probe = llm.generate([{"prompt_token_ids": LOOP}], _greedy(), use_tqdm=False)[0].outputs[0]
        requests = [r for r in _workload(probe.token_ids[9], "\n\n") if r[0] != "stop_str"]
        finals.append(_run(llm.engine, requests)[0])
        if spec is not None:
            assert llm.engine.spec_stats.num_draft_tokens > 0
            assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks
        del llm
        torch.cuda.empty_cache()
    _assert_same(finals[1], finals[0])
    _assert_same(finals[2], finals[0])
    _assert_oracle_heads_walk(walk, lambda target, spec: LLM(target, speculative_config=spec, **gpu))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cuda_graphed_eagle_verify_matches_eager_and_no_speculation(path, heads, walk, async_scheduling, monkeypatch):  # noqa: F811
    """QSERVE_SPEC_GRAPHS=1 with EAGLE / EAGLE-3 heads on the GPU: verify steps replay captured row
    graphs that return the hidden states the heads read; random heads keep the greedy outputs of the
    eager verify and of no speculation (float32), oracle heads keep > 95% of their drafts (which
    collapses when the heads get no or misplaced hidden states)."""
    from tests.integration.test_spec_decode_graphs import PathLog, _cuda_engine

    finals = {}
    for name, spec, graphs in (
        ("none", None, False),
        ("eagle-eager", _spec(heads, "eagle"), False),
        ("eagle-graphs", _spec(heads, "eagle"), True),
        ("eagle3-graphs", _spec(heads, "eagle3"), True),
    ):
        llm = _cuda_engine(path, spec, graphs, monkeypatch, async_scheduling=async_scheduling)
        engine = llm.engine
        probe = llm.generate([{"prompt_token_ids": LOOP}], _greedy(), use_tqdm=False)[0].outputs[0]
        requests = [r for r in _workload(probe.token_ids[9], "\n\n") if r[0] != "stop_str"]
        log = PathLog(engine.runner)
        finals[name] = _run(engine, requests)[0]
        if graphs:
            row_graphs = engine.runner.row_graphs
            assert isinstance(next(iter(row_graphs.graphs.values())), torch.cuda.CUDAGraph)
            assert row_graphs.hidden_taps == engine.runner.spec_hidden_layers
            assert "rows" in log.kinds(), "verify steps replayed the row graphs"
        if spec is not None:
            assert engine.spec_stats.num_draft_tokens > 0
            assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
        del llm, engine
        torch.cuda.empty_cache()
    for name in ("eagle-eager", "eagle-graphs", "eagle3-graphs"):
        _assert_same(finals[name], finals["none"])
    logs = []

    def make_llm(target, spec):  # noqa: ANN001, ANN202
        llm = _cuda_engine(target, spec, True, monkeypatch, async_scheduling=async_scheduling)
        logs.append(PathLog(llm.engine.runner))
        return llm

    def replayed_rows(llm) -> None:  # noqa: ANN001
        assert "rows" in logs[-1].kinds(), "verify steps replayed the row graphs"

    _assert_oracle_heads_walk(walk, make_llm, replayed_rows)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_prompt_steps_take_the_piecewise_graphs_when_asked(path, heads, reference, method, monkeypatch):  # noqa: F811
    """QSERVE_PIECEWISE_SPEC=1 with piecewise graphs (StaticReplay stand-ins on CPU): a step that asks
    for an EAGLE head's hidden states and fits no decode or row graph (a prompt chunk; a plain decode
    when the decode graphs hold no taps) runs through the pieces, whose output is the final hidden
    states the head reads; EAGLE-3's tapped streams are not their output, so its steps stay eager.
    Outputs are token-identical to no speculation and every step hands the head the hidden states the
    engine without the switch hands it."""
    from qserve.engine.engine import PIECEWISE_SPEC_ENV
    from qserve.runner.piecewise_graphs import PIECEWISE_BUCKETS_ENV, PIECEWISE_GRAPHS_ENV

    monkeypatch.setenv(PIECEWISE_GRAPHS_ENV, "1")
    monkeypatch.setenv(PIECEWISE_BUCKETS_ENV, "8,16,32,64")
    monkeypatch.setenv("QSERVE_EAGLE_DECODE_GRAPHS", "0")  # plain decodes with no taps: pieces too
    runs = []
    for takes in ("0", "1"):
        monkeypatch.setenv(PIECEWISE_SPEC_ENV, takes)
        runs.append(_recorded_run(path, heads, method, reference)[1])
    off, on = runs
    asked_off = [kind for _, asks, kind, _ in off if asks]
    asked_on = [kind for _, asks, kind, _ in on if asks]
    assert "piecewise" not in asked_off
    if method == "eagle":  # prompt chunks and plain decodes that asked: pieces instead of eager steps
        assert "piecewise" in asked_on and asked_on.count("eager") < asked_off.count("eager"), asked_on
    else:
        assert asked_on == asked_off, "EAGLE-3's tapped streams are not the pieces' output"
    _assert_same_hidden(on, off)


@pytest.mark.parametrize("switches", ["decode_graphs", "piecewise"])
def test_eagle_graph_switches_keep_the_outputs_under_async_scheduling(path, heads, switches, monkeypatch):  # noqa: F811
    """Async scheduling while speculation is off (more requests than ``disable_by_batch_size``): two
    long prompts chunked under a 16-token budget give prompt steps in a row in the async order, each
    launched before the head has read the last one's hidden states. With QSERVE_EAGLE_DECODE_GRAPHS=1
    or QSERVE_PIECEWISE_SPEC=1 the head reads exactly the hidden states its step returned (copied out
    of the decode graphs' or the pieces' static buffers, which the next replay rewrites), and the
    outputs stay token-identical to no speculation (which alone would not show wrong states: the
    rejection sampler keeps the target's tokens whatever the head drafts)."""
    from qserve.engine.engine import EAGLE_DECODE_GRAPHS_ENV, PIECEWISE_SPEC_ENV
    from qserve.runner.piecewise_graphs import PIECEWISE_BUCKETS_ENV, PIECEWISE_GRAPHS_ENV
    from tests.integration.test_spec_decode_graphs import PathLog, install_graphs

    monkeypatch.setenv(EAGLE_DECODE_GRAPHS_ENV, "1" if switches == "decode_graphs" else "0")
    monkeypatch.setenv(PIECEWISE_SPEC_ENV, "1" if switches == "piecewise" else "0")
    monkeypatch.setenv(PIECEWISE_GRAPHS_ENV, "1")
    monkeypatch.setenv(PIECEWISE_BUCKETS_ENV, "8,16")
    prompts = [[9 + (7 * i + j) % 50 for i in range(40)] for j in (0, 3)]
    requests = [(f"long{j}", prompt, _greedy(max_tokens=16)) for j, prompt in enumerate(prompts)]
    requests.append(("loop", LOOP, _greedy(max_tokens=24)))
    engine_args = dict(async_scheduling=True, max_num_batched_tokens=16, **ARGS)
    want, _ = _run(LLM(path, **engine_args).engine, requests)
    spec = _spec(heads, "eagle", disable_by_batch_size=1)
    llm = LLM(path, speculative_config=spec, **engine_args)
    install_graphs(llm)
    engine = llm.engine
    log = PathLog(engine.runner)
    # id of a step's hidden states -> (them, kept alive so the id stays theirs; their values at launch)
    returned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    launch, observe = engine.runner.launch, engine.proposer.observe
    compared = []

    def launched(scheduler_output, previous=None):  # noqa: ANN001, ANN202
        step = launch(scheduler_output, previous)
        if step.spec_hidden_states is not None:
            states = step.spec_hidden_states
            returned[id(states)] = (states, states.clone())
        return step

    def observed(rows, target_hidden):  # noqa: ANN001, ANN202
        torch.testing.assert_close(target_hidden, returned[id(target_hidden)][1], atol=0, rtol=0)
        compared.append(len(rows))
        return observe(rows, target_hidden)

    engine.runner.launch, engine.proposer.observe = launched, observed
    got, _ = _run(engine, requests)
    _assert_same(got, want)
    assert len(compared) >= 5
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert ("decode" if switches == "decode_graphs" else "piecewise") in log.kinds()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cuda_eagle_decode_graphs_match_no_speculation(path, heads, walk, async_scheduling, monkeypatch):  # noqa: F811
    """QSERVE_EAGLE_DECODE_GRAPHS=1 on the GPU: decode graphs captured with the heads' taps; the plain
    decode steps of a speculating engine replay them (captured graphs, not eager steps), the greedy
    outputs equal no speculation's (float32), and an oracle head keeps > 95% of its drafts (which
    collapses when the decode graphs hand it no or misplaced hidden states)."""
    from tests.integration.test_spec_decode_graphs import PathLog, _cuda_engine

    monkeypatch.setenv("QSERVE_EAGLE_DECODE_GRAPHS", "1")
    finals = {}
    for name, spec in (("none", None), ("eagle", _spec(heads, "eagle")), ("eagle3", _spec(heads, "eagle3"))):
        llm = _cuda_engine(path, spec, True, monkeypatch, async_scheduling=async_scheduling)
        engine = llm.engine
        probe = llm.generate([{"prompt_token_ids": LOOP}], _greedy(), use_tqdm=False)[0].outputs[0]
        requests = [r for r in _workload(probe.token_ids[9], "\n\n") if r[0] != "stop_str"]
        log = PathLog(engine.runner)
        launches = _launch_log(engine, log)
        finals[name] = _run(engine, requests)[0]
        if spec is not None:
            graphs = engine.runner.decode_graphs
            assert graphs.hidden_taps == engine.runner.spec_hidden_layers
            assert isinstance(next(iter(graphs.graphs.values())), torch.cuda.CUDAGraph)
            replayed = [kind for plain, asks, kind, _ in launches if plain and asks]
            assert replayed and set(replayed) == {"decode"}, launches
            assert engine.spec_stats.num_draft_tokens > 0
            assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
        del llm, engine
        torch.cuda.empty_cache()
    for name in ("eagle", "eagle3"):
        _assert_same(finals[name], finals["none"])
    _assert_oracle_heads_walk(
        walk, lambda target, spec: _cuda_engine(target, spec, True, monkeypatch, async_scheduling=async_scheduling)
    )


def test_the_heads_weights_count_and_serve_takes_one_model(path, heads, tmp_path, capsys):  # noqa: F811
    import argparse

    from qserve.commands import plan, serve
    from qserve.spec_decode.eagle_head import eagle_head_bytes

    plain = LLM(path, gpu_memory_budget="256MiB", **ARGS).engine.memory_plan
    engine = LLM(path, gpu_memory_budget="256MiB", speculative_config=_spec(heads, "eagle3"), **ARGS).engine
    head = engine._eagle_head
    assert engine.memory_plan.weights_bytes == plain.weights_bytes + sum(
        t.numel() * t.element_size() for t in [*head.parameters(), *head.buffers()]
    )
    parser = argparse.ArgumentParser()
    plan.register(parser)
    extra = ["--speculative-config", json.dumps(_spec(heads, "eagle3"))]
    assert plan.run(parser.parse_args([path, "--gpu-memory-budget", "256MiB", "--json", *extra])) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["draft_weights_bytes"] == eagle_head_bytes(heads["eagle3"], "eagle3", torch.float16) > 0
    # the head's KV indexed by the target's blocks: each page larger by its share (float16 here)
    config = head.config.model
    assert result["shadow_kv_bytes_per_token"] == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    assert result["shadow_scratch_bytes"] == 256 * 16 * result["shadow_kv_bytes_per_token"]  # the CLI's defaults
    parser = argparse.ArgumentParser()
    plan.register(parser)
    assert plan.run(parser.parse_args([path, "--gpu-memory-budget", "256MiB", "--json"])) == 0
    without = json.loads(capsys.readouterr().out)
    assert without["shadow_kv_bytes_per_token"] == 0
    per_page = (without["kv_bytes_per_token"] + result["shadow_kv_bytes_per_token"]) * 16
    left = result["budget_bytes"] - result["weights_bytes"] - result["activation_bytes"] - result["overhead_bytes"]
    assert result["num_kv_blocks"] == (left - result["shadow_scratch_bytes"]) // per_page
    parser = argparse.ArgumentParser()
    serve.register(parser)
    args = parser.parse_args(
        [f"a={tmp_path}", f"b={tmp_path}", "--speculative-config", json.dumps(_spec(heads, "eagle"))]
    )
    with pytest.raises(ValueError, match="an EAGLE head serves one model"):
        serve.build_host_factory(args)
    with pytest.raises(ValueError, match=r"speculative_config\.model is required with method 'eagle'"):
        LLM(path, speculative_config={"method": "eagle", "num_speculative_tokens": 2}, **ARGS)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_graphed_verify_steps_hand_the_head_their_hidden_states(walk, method):
    """QSERVE_SPEC_GRAPHS=1 with an EAGLE head: verify steps replay the row graphs (before, a step
    asking for hidden states always ran eagerly, so the graphs were captured for nothing) and hand
    the head the hidden states those graphs wrote. Were they missing or rows off, the head would see
    zero features or features of the wrong position and the oracle head's acceptance would collapse."""
    from tests.integration.test_spec_decode_graphs import PathLog, install_graphs

    target, heads, perm = walk
    prompts = [{"prompt_token_ids": [PERM_FIRST + s for s in (3, 9, 17, 40)]}, {"prompt_token_ids": [PERM_FIRST + 5]}]
    llm = LLM(target, speculative_config=_spec(heads, method), **ARGS)
    install_graphs(llm)
    engine = llm.engine
    assert engine.runner.row_graphs is not None
    assert engine.runner.row_graphs.hidden_taps == engine.runner.spec_hidden_layers
    log = PathLog(engine.runner)
    outputs = llm.generate(prompts, _greedy(max_tokens=30), use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == walk_tokens(perm, 40, 30)
    rows = [entry for entry in log.entries if entry[0] == "rows"]
    assert len(rows) >= 5, f"verify steps replayed the row graphs: {log.kinds()}"
    stats = engine.spec_stats
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.95


def _launch_log(engine, log) -> list[tuple[bool, bool, str, torch.Tensor | None]]:  # noqa: ANN001
    """Per launch: (a plain decode step, it asked for the head's hidden states, the path it took, a
    copy of the hidden states it returned); ``log`` is the runner's PathLog, read after each launch."""
    launches: list[tuple[bool, bool, str, torch.Tensor | None]] = []
    launch = engine.runner.launch

    def spy(scheduler_output, previous=None):  # noqa: ANN001, ANN202
        before = len(log.entries)
        step = launch(scheduler_output, previous)
        plain = scheduler_output.num_batched_tokens == len(scheduler_output.sequences)
        plain = plain and not scheduler_output.num_spec_tokens
        kind = log.entries[-1][0] if len(log.entries) > before else "none"
        states = step.spec_hidden_states
        launches.append(
            (plain, bool(scheduler_output.spec_hidden_states), kind, None if states is None else states.clone())
        )
        return step

    engine.runner.launch = spy
    return launches


def _recorded_run(checkpoint: str, heads: dict[str, str], method: str, workload, graphs: bool = True):  # noqa: ANN001, ANN202
    """The ``reference`` fixture's workload (synchronous order) with a random head of ``method``,
    through the graphs ``install_graphs`` captures under the current environment (``graphs``):
    outputs token-identical to no speculation, drafts made, every page back. Returns (engine,
    launches)."""
    from tests.integration.test_spec_decode_graphs import PathLog, install_graphs

    requests, want, _ = workload
    llm = LLM(checkpoint, async_scheduling=False, speculative_config=_spec(heads, method), **ARGS)
    engine = llm.engine
    if graphs:
        install_graphs(llm)
    launches = _launch_log(engine, PathLog(engine.runner))
    got, _ = _run(engine, requests)
    _assert_same(got, want)
    assert engine.spec_stats.num_draft_tokens > 0
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    return engine, launches


def _assert_same_hidden(got: list[tuple], want: list[tuple]) -> None:
    """Step by step, the hidden states two runs of the same workload handed the head."""
    assert len(got) == len(want)
    for (*_, a), (*_, b) in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_graphed_eagle_verify_is_token_identical_with_the_eager_hidden_states(  # noqa: F811
    path,  # noqa: F811
    heads,
    reference,  # noqa: F811
    method,
    monkeypatch,
):
    """The workload with random heads, QSERVE_SPEC_GRAPHS=1 (StaticReplay stand-ins) against the
    same engine without graphs: outputs token-identical to no speculation, the same steps, and every
    step's hidden states for the head equal to the eager ones, verify steps replaying row graphs."""
    from qserve.engine.engine import SPEC_BACKOFF_ENV

    monkeypatch.setenv(SPEC_BACKOFF_ENV, "2,16")  # the random heads' probes are what is checked: n-gram's back-off
    _, eager = _recorded_run(path, heads, method, reference, graphs=False)
    _, graphed = _recorded_run(path, heads, method, reference)
    eager_kinds, graph_kinds = [launch[2] for launch in eager], [launch[2] for launch in graphed]
    assert "rows" not in eager_kinds and graph_kinds.count("rows") >= 5, graph_kinds
    _assert_same_hidden(graphed, eager)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_decode_graphs_replay_the_plain_decode_steps_of_speculation(
    path,  # noqa: F811
    heads,
    reference,  # noqa: F811
    method,
    monkeypatch,
):
    """By default (QSERVE_EAGLE_DECODE_GRAPHS unset; StaticReplay stand-ins on CPU) the decode graphs
    carry the head's taps, so a plain decode step that asks for hidden states (speculation on, the sequence
    got no drafts) replays a decode graph instead of running eagerly (on an H100 such eager steps
    made EAGLE 10x slower than no speculation); outputs stay token-identical to no speculation and
    every step hands the head the hidden states the engine without the switch hands it."""
    runs = []
    for decode_graphs in ("0", None):  # off, then the default (unset): on
        if decode_graphs is None:
            monkeypatch.delenv("QSERVE_EAGLE_DECODE_GRAPHS", raising=False)
        else:
            monkeypatch.setenv("QSERVE_EAGLE_DECODE_GRAPHS", decode_graphs)
        engine, launches = _recorded_run(path, heads, method, reference)
        taps = engine.runner.decode_graphs.hidden_taps
        assert taps == (None if decode_graphs == "0" else engine.runner.spec_hidden_layers)
        runs.append(launches)
    eager, graphed = runs
    asked = [kind for plain, asks, kind, _ in eager if plain and asks]
    assert len(asked) >= 3 and set(asked) == {"eager"}, "with the switch at 0 these steps run eagerly"
    replayed = [kind for plain, asks, kind, _ in graphed if plain and asks]
    assert len(replayed) == len(asked) and set(replayed) == {"decode"}, graphed
    _assert_same_hidden(graphed, eager)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_the_head_never_writes_a_block_another_sequence_holds(path, heads, method):  # noqa: F811
    """A request served from the prefix cache shares full blocks with the running request that
    computed them (reference count 2). The newcomer's head catches up over those positions (a gap:
    zero features) but stores no KV in the shared blocks: it would overwrite what the running
    sequence's head wrote there from the target's real features (and, at a block's last position,
    for the running sequence's own next token). Outputs stay those of no speculation."""
    prompt = list(range(40, 58))  # 4 full blocks of 4, and 2 tokens
    newcomer = prompt + [3, 4]
    params = _greedy(max_tokens=20)

    def run(spec) -> tuple[dict, LLM]:  # noqa: ANN001
        llm = LLM(path, async_scheduling=False, speculative_config=spec, **ARGS)
        engine = llm.engine
        engine.add_request("first", {"prompt_token_ids": prompt}, params)
        for _ in range(3):
            engine.step()
        engine.add_request("second", {"prompt_token_ids": newcomer}, params)
        final = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    final[output.request_id] = output
        return final, llm

    want, _ = run(None)
    llm = LLM(path, async_scheduling=False, speculative_config=_spec(heads, method), **ARGS)
    engine = llm.engine
    proposer, pool = engine.proposer, engine.block_pool
    block_size, num_target = ARGS["block_size"], pool.num_blocks
    head_forward = proposer.head.forward
    written_shared, cached = [], []

    def spy(input_ids, positions, features, kv_caches, metadata):  # noqa: ANN001, ANN202
        slots = metadata.slot_mapping.tolist()
        written_shared.extend(
            s for s in slots if 0 <= s < num_target * block_size and pool.ref_count(s // block_size) > 1
        )
        return head_forward(input_ids, positions, features, kv_caches, metadata)

    proposer.head.forward = spy
    engine.add_request("first", {"prompt_token_ids": prompt}, params)
    for _ in range(3):
        engine.step()
    engine.add_request("second", {"prompt_token_ids": newcomer}, params)
    got = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                got[output.request_id] = output
        request = engine.scheduler.requests.get("second")
        if request is not None:
            cached.append(request.num_cached_tokens)
    _assert_same(got, want)
    assert max(cached) >= 3 * block_size, "the newcomer was served from the prefix cache"
    assert engine.spec_stats.num_draft_tokens > 0
    assert not written_shared, f"the head stored KV at slots of shared blocks: {sorted(set(written_shared))}"


def _drafting_run(  # noqa: ANN202
    checkpoint: str,
    heads: dict[str, str],
    method: str,
    workload,  # noqa: ANN001
    head_graphs: str | None,
    catch_up: list | None = None,
):
    """The ``reference`` workload with a random head and QSERVE_EAGLE_HEAD_GRAPHS=``head_graphs``
    (None: unset, the default: on; StaticReplay stand-ins on CPU): outputs token-identical to no
    speculation, every page back. Returns (every proposal's drafts, in order; the shape of every
    proposal drafted through the graphs; every draft's logits input, in order). ``catch_up``: with
    QSERVE_EAGLE_CATCH_UP_GRAPHS unset (the default: on), and every catch-up replay's rows per sequence
    appended to it; None: QSERVE_EAGLE_CATCH_UP_GRAPHS=0."""
    import os

    from qserve.engine.engine import EAGLE_CATCH_UP_GRAPHS_ENV, EAGLE_HEAD_GRAPHS_ENV
    from tests.integration.test_spec_decode_graphs import install_graphs

    if head_graphs is None:
        os.environ.pop(EAGLE_HEAD_GRAPHS_ENV, None)
    else:
        os.environ[EAGLE_HEAD_GRAPHS_ENV] = head_graphs
    if catch_up is None:
        os.environ[EAGLE_CATCH_UP_GRAPHS_ENV] = "0"
    else:
        os.environ.pop(EAGLE_CATCH_UP_GRAPHS_ENV, None)
    requests, want, _ = workload
    llm = LLM(checkpoint, async_scheduling=False, speculative_config=_spec(heads, method), **ARGS)
    engine = llm.engine
    install_graphs(llm)
    proposer = engine.proposer
    assert (proposer.graphs is not None) == (head_graphs != "0")
    assert (proposer.catch_up_graphs is not None) == (catch_up is not None)
    if catch_up is not None:
        catch_up_graphs = proposer.catch_up_graphs
        replay_catch_up = catch_up_graphs.catch_up

        def counted_catch_up(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            catch_up.append(list(args[2]))  # counts per sequence
            return replay_catch_up(*args, **kwargs)

        catch_up_graphs.catch_up = counted_catch_up
    proposals, replayed = [], []
    staged = []  # every replay's (positions, slots: [steps, rows]; each row's (first position, drafts))
    rows = []  # the rows of the proposal about to replay, read before the graphs draft
    in_graphs = proposer._draft_in_graphs

    def rows_of(batch, ready, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        mirrors = proposer._mirrors
        rows.append([(mirrors[batch[i].request_id].num_computed_tokens, batch[i].max_num_tokens) for i in ready])
        return in_graphs(batch, ready, *args, **kwargs)

    proposer._draft_in_graphs = rows_of
    propose = proposer.propose
    if proposer.graphs is not None:
        draft = proposer.graphs.draft

        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            positions, slots = args[2], args[3]  # [steps, rows]
            replayed.append(positions.shape)
            staged.append((positions.copy(), slots.copy(), rows.pop()))
            return draft(*args, **kwargs)

        proposer.graphs.draft = counted

    def spy(batch):  # noqa: ANN001, ANN202
        drafts = propose(batch)
        proposals.append([list(d) for d in drafts])
        return drafts

    proposer.propose = spy
    draft_tokens = proposer.head.draft_tokens
    inputs = []  # every draft's logits input (the catch-up's last row for a first draft), in order

    def recorded(logits_input):  # noqa: ANN001, ANN202
        inputs.append(logits_input.detach().clone())
        return draft_tokens(logits_input)

    proposer.head.draft_tokens = recorded
    got, _ = _run(engine, requests)
    _assert_same(got, want)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    # Drafting step j of a row with c drafts reads position base + j - 1 while j < c; past its count the
    # row stores nothing (slot -1: for a row of one draft the position it repeats is a caught-up one,
    # whose head KV must not be overwritten).
    repeats = 0
    for positions, slots, row_info in staged:
        for r, (base, count) in enumerate(row_info):
            for j in range(1, positions.shape[0] + 1):
                if j < count:
                    assert positions[j - 1, r] == base + j - 1, (positions, row_info)
                else:
                    assert slots[j - 1, r] == -1, (positions, slots, row_info)
                    repeats += 1
    return proposals, replayed, inputs, repeats


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_head_graphs_draft_what_the_eager_head_drafts(path, heads, reference, method, monkeypatch):  # noqa: F811
    """By default (QSERVE_EAGLE_HEAD_GRAPHS unset; StaticReplay stand-ins on CPU) a proposal's k - 1
    drafting forwards run through the head's graphs, one bucket-padded forward per draft with every row
    kept (a row that needs fewer drafts, near its max_tokens, repeats its last position with slot -1).
    Every proposal's drafts equal the eager head's (QSERVE_EAGLE_HEAD_GRAPHS=0: rows drop out as they
    finish), outputs stay token-identical to no speculation, and several-row proposals (pad rows up to
    the bucket) are among them."""
    from qserve.engine.engine import EAGLE_CATCH_UP_GRAPHS_ENV, EAGLE_HEAD_GRAPHS_ENV, SPEC_BACKOFF_ENV

    monkeypatch.setenv(SPEC_BACKOFF_ENV, "2,16")  # the random heads' probes are what is checked: n-gram's back-off
    monkeypatch.setenv(EAGLE_HEAD_GRAPHS_ENV, "0")  # restored after the test (_drafting_run sets them)
    monkeypatch.setenv(EAGLE_CATCH_UP_GRAPHS_ENV, "0")
    eager, none, _, _ = _drafting_run(path, heads, method, reference, "0")
    graphed, replayed, graphed_inputs, repeats = _drafting_run(path, heads, method, reference, None)
    assert repeats > 0  # rows of fewer drafts were among them
    assert none == [] and len(replayed) >= 5
    assert any(rows not in DEFAULT_BUCKETS for _, rows in replayed), replayed  # padded to a bucket
    assert graphed == eager
    assert any(len(d) == K for proposal in graphed for d in proposal)  # full proposals of k drafts
    assert any(0 < len(d) < K for proposal in graphed for d in proposal)  # and shorter ones
    # QSERVE_EAGLE_CATCH_UP_GRAPHS unset too (on): the catch-ups after plain decodes (1 position) and verify
    # steps (up to k + 1) replay the catch-up graphs; every proposal's drafts are still the eager head's
    catch_up: list[list[int]] = []
    both, _, both_inputs, _ = _drafting_run(path, heads, method, reference, None, catch_up)
    assert both == eager
    assert len(catch_up) >= 5 and any(len(replay) > 1 for replay in catch_up)  # several sequences a replay
    # the head's states themselves, not only their argmax: a replay at a wrong position moves them
    assert len(both_inputs) == len(graphed_inputs)
    for got, want in zip(both_inputs, graphed_inputs, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_catch_up_graphs_take_a_verify_steps_kept_positions(walk, method, monkeypatch):
    """QSERVE_EAGLE_CATCH_UP_GRAPHS=1 with an oracle head (every draft accepted): the catch-up after a
    verify step covers up to k + 1 positions per sequence and replays the catch-up graphs (StaticReplay
    stand-ins on CPU) in their k + 1-row layout (pad rows first); the proposals and the head's states
    equal those of the eager catch-up, the outputs are the walk, and acceptance stays > 95% (which
    collapses when a replay gathers a wrong row or reads a wrong token or feature; this head's drafts do
    not depend on positions: the random heads' test above catches a wrong one)."""
    from qserve.engine.engine import EAGLE_CATCH_UP_GRAPHS_ENV
    from tests.integration.test_spec_decode_graphs import install_graphs

    target, heads, perm = walk
    prompts = [{"prompt_token_ids": [PERM_FIRST + s for s in (3, 9, 17, 40)]}, {"prompt_token_ids": [PERM_FIRST + 5]}]
    runs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(EAGLE_CATCH_UP_GRAPHS_ENV, switch)
        llm = LLM(target, async_scheduling=False, speculative_config=_spec(heads, method), **ARGS)
        install_graphs(llm)
        proposer = llm.engine.proposer
        proposals, counts, inputs = [], [], []
        propose = proposer.propose
        proposer.propose = lambda batch, _p=propose, _seen=proposals: _seen.append(_p(batch)) or _seen[-1]
        draft_tokens = proposer.head.draft_tokens
        proposer.head.draft_tokens = lambda x, _d=draft_tokens, _in=inputs: _in.append(x.clone()) or _d(x)
        if switch == "1":
            catch_up = proposer.catch_up_graphs.catch_up
            proposer.catch_up_graphs.catch_up = lambda *a, _c=catch_up, _n=counts, **kw: _n.extend(a[2]) or _c(*a, **kw)
        outputs = llm.generate(prompts, _greedy(max_tokens=30), use_tqdm=False)
        assert outputs[0].outputs[0].token_ids == walk_tokens(perm, 40, 30)
        stats = llm.engine.spec_stats
        assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.95
        runs[switch] = proposals, counts, inputs
    assert runs["1"][0] == runs["0"][0]
    assert max(runs["1"][1]) == K + 1 and min(runs["1"][1]) >= 1, runs["1"][1]
    for got, want in zip(runs["1"][2], runs["0"][2], strict=True):  # the head's states, not only argmaxes
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_eagle_head_graphs_switch_refuses_a_value_it_does_not_know(path, heads, monkeypatch):  # noqa: F811
    from qserve.engine.engine import EAGLE_HEAD_GRAPHS_ENV

    monkeypatch.setenv(EAGLE_HEAD_GRAPHS_ENV, "on")
    with pytest.raises(ValueError, match="QSERVE_EAGLE_HEAD_GRAPHS='on'"):
        llm = LLM(path, async_scheduling=False, speculative_config=_spec(heads, "eagle"), **ARGS)
        install = __import__("tests.integration.test_spec_decode_graphs", fromlist=["install_graphs"])
        install.install_graphs(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cuda_eagle_head_graphs_match_no_speculation(path, heads, walk, async_scheduling, monkeypatch):  # noqa: F811
    """QSERVE_EAGLE_HEAD_GRAPHS=1 and QSERVE_EAGLE_CATCH_UP_GRAPHS=1 on the GPU: the heads' drafting and
    catch-up forwards are captured CUDA graphs and replay; greedy outputs equal no speculation's
    (float32), and an oracle head keeps > 95% of its drafts (which collapses when a replay reads a
    wrong row, feature or block)."""
    from qserve.engine.engine import EAGLE_CATCH_UP_GRAPHS_ENV, EAGLE_HEAD_GRAPHS_ENV
    from tests.integration.test_spec_decode_graphs import _cuda_engine

    monkeypatch.setenv(EAGLE_HEAD_GRAPHS_ENV, "1")
    monkeypatch.setenv(EAGLE_CATCH_UP_GRAPHS_ENV, "1")
    finals = {}
    for name, spec in (("none", None), ("eagle", _spec(heads, "eagle")), ("eagle3", _spec(heads, "eagle3"))):
        llm = _cuda_engine(path, spec, True, monkeypatch, async_scheduling=async_scheduling)
        engine = llm.engine
        probe = llm.generate([{"prompt_token_ids": LOOP}], _greedy(), use_tqdm=False)[0].outputs[0]
        requests = [r for r in _workload(probe.token_ids[9], "\n\n") if r[0] != "stop_str"]
        replays = []
        if spec is not None:
            graphs = engine.proposer.graphs
            assert graphs is not None and isinstance(next(iter(graphs.graphs.values())), torch.cuda.CUDAGraph)
            catch_up = engine.proposer.catch_up_graphs
            assert catch_up is not None and isinstance(next(iter(catch_up.graphs.values())), torch.cuda.CUDAGraph)
            draft = graphs.draft
            graphs.draft = lambda *a, _draft=draft, _seen=replays, **kw: _seen.append(a[2].shape) or _draft(*a, **kw)
        finals[name] = _run(engine, requests)[0]
        if spec is not None:
            assert replays and engine.spec_stats.num_draft_tokens > 0
            assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
        del llm, engine
        torch.cuda.empty_cache()
    for name in ("eagle", "eagle3"):
        _assert_same(finals[name], finals["none"])

    def graphed(llm) -> None:  # noqa: ANN001
        assert llm.engine.proposer.graphs is not None and llm.engine.proposer.catch_up_graphs is not None

    _assert_oracle_heads_walk(
        walk,
        lambda target, spec: _cuda_engine(target, spec, True, monkeypatch, async_scheduling=async_scheduling),
        graphed,
    )
