"""CUDA graphs of speculative steps (``QSERVE_SPEC_GRAPHS=1``): multi-row graphs for verify steps
(k + 1 rows per sequence, pad rows where a sequence has fewer drafts) and a draft model's decode
and catch-up steps, checked on CPU through the same static-shaped inputs (``DecodeGraphs.capture``
off CUDA reruns the static-buffer forward eagerly, so all but the capture runs): the row layout,
pad rows that never store KV nor change a real row, the hidden states an EAGLE / EAGLE-3 head reads
returned by a replayed step as the eager step returns them, greedy outputs token-identical to decoding
without speculation, and a step with speculation disabled by batch size that takes exactly the
runner path of no speculation. The attention kernels run the padded layout under the Triton
interpreter. ``-m gpu`` captures for real and compares against the eager verify and no speculation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qserve import LLM
from qserve.engine.engine import SPEC_GRAPHS_ENV, spec_graph_sizes
from qserve.runner.cuda_graphs import DecodeGraphs, StaticReplay, static_positions, static_rows
from qserve.runner.model_runner import ModelRunner, pad_block_tables
from qserve.spec_decode import parse_speculative_config
from tests.helpers.kv_writes import assert_step_wrote_only
from tests.integration.test_spec_decode import (  # noqa: F401 - fixtures and the shared workload
    ARGS,
    LOOP,
    NGRAM,
    _assert_same,
    _greedy,
    _run,
    path,
    reference,
)

K = NGRAM["num_speculative_tokens"]


def install_graphs(llm: LLM) -> None:
    """What the engine does on CUDA with QSERVE_SPEC_GRAPHS=1, with StaticReplay stand-ins on CPU
    (decode graphs with an EAGLE head's taps where QSERVE_EAGLE_DECODE_GRAPHS=1 asks for them)."""
    engine = llm.engine
    engine.runner.capture_decode_graphs(
        engine.config.max_num_seqs, engine.max_model_len, hidden_taps=engine.decode_graph_hidden_taps()
    )
    if engine.spec_config is not None:
        engine._capture_spec_graphs()


class PathLog:
    """Which path each forward of a runner took: ("decode", bucket), ("rows", bucket, counts),
    ("piecewise", num_tokens) or ("eager", num_tokens)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.entries: list[tuple] = []
        eager, piecewise = runner._forward_eager, runner._forward_piecewise

        def forward_eager(input_ids, *args, **kwargs):  # noqa: ANN001, ANN202
            self.entries.append(("eager", len(input_ids)))
            return eager(input_ids, *args, **kwargs)

        def forward_piecewise(input_ids, *args, **kwargs):  # noqa: ANN001, ANN202
            self.entries.append(("piecewise", len(input_ids)))
            return piecewise(input_ids, *args, **kwargs)

        runner._forward_eager = forward_eager
        runner._forward_piecewise = forward_piecewise
        for graphs, kind in ((runner.decode_graphs, "decode"), (runner.row_graphs, "rows")):
            if graphs is not None:
                self._spy(graphs, kind)

    def _spy(self, graphs: DecodeGraphs, kind: str) -> None:
        if kind == "decode":
            replay = graphs.replay

            def logged(input_ids, *args, **kwargs):  # noqa: ANN001, ANN202
                self.entries.append(("decode", graphs.bucket_for(len(input_ids))))
                return replay(input_ids, *args, **kwargs)

            graphs.replay = logged
        else:
            replay_rows = graphs.replay_rows

            def logged_rows(input_ids, counts, *args, **kwargs):  # noqa: ANN001, ANN202
                self.entries.append(("rows", graphs.bucket_for(len(counts)), tuple(counts.tolist())))
                return replay_rows(input_ids, counts, *args, **kwargs)

            graphs.replay_rows = logged_rows

    def kinds(self) -> list[str]:
        return [entry[0] for entry in self.entries]


# ---------------------------------------------------------------------------------------- layout


def test_static_rows_put_each_sequences_tokens_last_and_positions_follow():
    counts = np.array([3, 1, 2])
    assert static_rows(counts, 3).tolist() == [0, 1, 2, 5, 7, 8]
    # seq_lens 10, 6, 8 (and a pad sequence of length 3): rows end at each sequence's last position
    positions = static_positions(np.array([10, 6, 8, 3]), 3)
    assert positions.tolist() == [7, 8, 9, 3, 4, 5, 5, 6, 7, 0, 1, 2]
    starts = np.array([7, 5, 6])  # each sequence's first new token
    real = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
    assert positions[static_rows(counts, 3)].tolist() == real.tolist()


def test_spec_graph_sizes_stay_within_the_batch_threshold_and_the_step_budget():
    spec = parse_speculative_config({**NGRAM, "num_speculative_tokens": 4, "disable_by_batch_size": 64})
    assert spec_graph_sizes(spec, 256, 2048) == (64, 64, 64)
    always = parse_speculative_config({**NGRAM, "num_speculative_tokens": 4})
    assert spec_graph_sizes(always, 256, 2048) == (256, 256, 256)
    assert spec_graph_sizes(always, 256, 512) == (102, 256, 256)  # 102 x 5 rows <= 512 tokens
    assert spec_graph_sizes(always, 256, 4) == (0, 4, 2)  # no verify graph of 5 rows fits 4 tokens


# ------------------------------------------------------------------ one step, graph against eager


def _step_inputs(runner: ModelRunner, counts: list[int], seq_lens: list[int], gen: torch.Generator):
    """A step of len(counts) sequences (``counts[i]`` new tokens ending at ``seq_lens[i]``) over
    distinct blocks: (input_ids, positions, slots, table_lens, flat_tables, sample_rows)."""
    bs = runner.block_size
    counts_a, lens = np.array(counts, dtype=np.int64), np.array(seq_lens, dtype=np.int64)
    blocks = -(-lens // bs)  # [S]
    flat = np.random.default_rng(0).permutation(runner.kv_caches[0][0].shape[0] - 1)[: blocks.sum()] + 1
    offsets = np.cumsum(blocks) - blocks
    positions = np.concatenate([np.arange(s - n, s) for n, s in zip(counts, seq_lens)])  # [T]
    seq_of = np.repeat(np.arange(len(counts)), counts_a)
    slots = flat[offsets[seq_of] + positions // bs] * bs + positions % bs  # [T]
    vocab = runner.config.vocab_size
    input_ids = torch.randint(3, vocab, (int(counts_a.sum()),), generator=gen).tolist()
    ends = np.cumsum(counts_a)
    # a verify step's rows: every token of each sequence (its last known token and its drafts)
    sample_rows = np.arange(int(ends[-1]), dtype=np.int64)
    return input_ids, positions, slots.astype(np.int64), blocks, flat.astype(np.int64), counts_a, lens, sample_rows


@pytest.mark.parametrize("counts", [[1, 3, 4], [4], [2, 2, 1, 4, 3]], ids=["padded", "full", "bucket-pad"])
def test_row_graph_logits_equal_eager_and_pad_rows_store_nothing(path, counts):  # noqa: F811
    """A verify-shaped step through the static layout (pad rows before each sequence's tokens, pad
    sequences up to the bucket) gives the eager step's logits at every real row, stores the same
    K/V for the real tokens and touches no other slot: pad rows sit at positions of tokens already
    in the cache, and writing there would corrupt them."""
    llm = LLM(path, **ARGS)
    runner = llm.engine.runner
    q = K + 1
    gen = torch.Generator().manual_seed(len(counts))
    for key, value in runner.kv_caches:  # a context of random K/V everywhere
        key.normal_(generator=gen)
        value.normal_(generator=gen)
    seq_lens = [9 + 3 * i for i in range(len(counts))]
    ids, positions, slots, table_lens, flat, counts_a, lens, sample_rows = _step_inputs(runner, counts, seq_lens, gen)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    qsl = np.concatenate(([0], np.cumsum(counts_a)))
    eager_logits, _, _, _ = runner._forward_eager(
        ids, positions, slots, table_lens, flat, qsl, lens, int(counts_a.max()), sample_rows, []
    )
    after_eager = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (key, value), (k0, v0) in zip(runner.kv_caches, before):
        key.copy_(k0)
        value.copy_(v0)

    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, 8, llm.engine.max_model_len, runner.block_size, runner.device,
        buckets=(1, 2, 8), query_len=q,
    )  # fmt: skip
    graphs.capture()
    assert all(isinstance(g, StaticReplay) for g in graphs.graphs.values())
    assert graphs.fits_rows(counts_a, lens, len(sample_rows))
    graph_logits = graphs.replay_rows(
        ids, counts_a, lens, slots, pad_block_tables(table_lens, flat).astype(np.int32), sample_rows
    )
    torch.testing.assert_close(graph_logits, eager_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1))

    bs = runner.block_size
    assert_step_wrote_only(runner.kv_caches, before, after_eager, slots)
    assert bs and graphs.bucket_for(len(counts)) >= len(counts)


def _eager_step_over_random_kv(
    checkpoint: str, counts: list[int], seq_lens: list[int], seed: int, taps: tuple[int, ...]
):  # noqa: ANN202
    """An engine whose KV caches hold random K/V, one step's inputs (``_step_inputs``) and the eager
    forward's (logits, hidden states for an EAGLE head with ``taps``) of that step; the caches are
    put back as they were, so a graph can replay the same step over the same context."""
    llm = LLM(checkpoint, **ARGS)
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(seed)
    for key, value in runner.kv_caches:
        key.normal_(generator=gen)
        value.normal_(generator=gen)
    step = _step_inputs(runner, counts, seq_lens, gen)
    ids, positions, slots, table_lens, flat, counts_a, lens, sample_rows = step
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    qsl = np.concatenate(([0], np.cumsum(counts_a)))
    logits, _, _, hidden = runner._forward_eager(
        ids, positions, slots, table_lens, flat, qsl, lens, int(counts_a.max()), sample_rows, [], spec_taps=taps
    )
    for (key, value), (k0, v0) in zip(runner.kv_caches, before):
        key.copy_(k0)
        value.copy_(v0)
    return llm, step, logits, hidden


@pytest.mark.parametrize("taps", [(), (1, 0, 1)], ids=["eagle", "eagle3"])
def test_row_graph_returns_the_eager_hidden_states_for_an_eagle_head(path, taps):  # noqa: F811
    """Graphs captured with an EAGLE head's taps write every row's hidden states (the final ones, or
    the residual streams entering the tapped layers, concatenated) into their static buffer, and a
    padded verify step gets back its real tokens' rows, in token order: the eager forward's hidden
    states. What it gets is a copy: the next replay rewrites the buffer, not the step's result."""
    counts = [1, 3, 4]
    llm, step, eager_logits, eager_hidden = _eager_step_over_random_kv(path, counts, [9, 12, 15], 7, taps)
    runner = llm.engine.runner
    ids, positions, slots, table_lens, flat, counts_a, lens, sample_rows = step
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, 8, llm.engine.max_model_len, runner.block_size, runner.device,
        buckets=(1, 2, 8), query_len=K + 1, hidden_taps=taps,
    )  # fmt: skip
    graphs.capture()
    width = runner.config.hidden_size * max(1, len(taps))
    assert graphs.spec_hidden is not None and graphs.spec_hidden.shape == (8 * (K + 1), width)
    tables = pad_block_tables(table_lens, flat).astype(np.int32)
    graph_logits = graphs.replay_rows(ids, counts_a, lens, slots, tables, sample_rows)
    hidden = graphs.spec_hidden_of(counts_a)
    assert hidden.shape == eager_hidden.shape == (sum(counts), width)
    torch.testing.assert_close(hidden, eager_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(graph_logits, eager_logits, atol=1e-4, rtol=1e-4)
    kept = hidden.clone()
    graphs.replay_rows(list(reversed(ids)), counts_a, lens, slots, tables, sample_rows)
    assert not torch.equal(graphs.spec_hidden_of(counts_a), kept), "the second step's hidden states differ"
    assert torch.equal(hidden, kept), "a replay rewrote the hidden states an earlier step returned"
    with pytest.raises(ValueError, match="LoRA"):
        DecodeGraphs(
            runner.model, runner.kv_caches, 2, 64, runner.block_size, runner.device, max_loras=2, hidden_taps=()
        )


@pytest.mark.parametrize("taps", [(), (1, 0, 1)], ids=["eagle", "eagle3"])
def test_decode_graph_returns_the_eager_hidden_states_for_an_eagle_head(path, taps):  # noqa: F811
    """Decode graphs captured with an EAGLE head's taps (QSERVE_EAGLE_DECODE_GRAPHS=1) return the
    same logits as the eager forward of a plain decode step and, one row per sequence in order, the
    hidden states the eager forward gives the head; the batch is padded to a bucket."""
    counts = [1, 1, 1]
    llm, step, eager_logits, eager_hidden = _eager_step_over_random_kv(path, counts, [9, 12, 15], 11, taps)
    runner = llm.engine.runner
    ids, positions, slots, table_lens, flat, counts_a, lens, sample_rows = step
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, 8, llm.engine.max_model_len, runner.block_size, runner.device,
        buckets=(1, 2, 4, 8), hidden_taps=taps,
    )  # fmt: skip
    graphs.capture()
    assert graphs.bucket_for(len(counts)) == 4, "a padded batch"
    tables = pad_block_tables(table_lens, flat).astype(np.int32)
    graph_logits = graphs.replay(ids, positions, slots, tables)
    hidden = graphs.spec_hidden_of(counts_a)
    width = runner.config.hidden_size * max(1, len(taps))
    assert hidden.shape == eager_hidden.shape == (len(counts), width)
    torch.testing.assert_close(hidden, eager_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(graph_logits, eager_logits, atol=1e-4, rtol=1e-4)


def test_row_graphs_refuse_what_they_cannot_hold(path):  # noqa: F811
    runner = LLM(path, **ARGS).engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 4, 64, runner.block_size, runner.device, query_len=3)
    assert graphs.fits_rows(np.array([1, 3]), np.array([3, 8]), 4)
    assert not graphs.fits_rows(np.array([1, 4]), np.array([3, 8]), 5), "more tokens than rows"
    assert not graphs.fits_rows(np.array([1, 2]), np.array([2, 8]), 3), "a pad row would sit before position 0"
    assert not graphs.fits_rows(np.array([1] * 5), np.array([8] * 5), 5), "more sequences than the largest bucket"
    assert not graphs.fits_rows(np.array([1, 2]), np.array([3, 8]), 0), "no sampling row"
    small = DecodeGraphs(
        runner.model, runner.kv_caches, 4, 64, runner.block_size, runner.device, query_len=3, max_sample_rows=5
    )
    assert small.sample_rows_of(4) == 5 and small.logits.shape[0] == 5
    assert not small.fits_rows(np.array([3, 3]), np.array([8, 8]), 6), "more logit rows than the graph computes"
    shared = DecodeGraphs(
        runner.model, runner.kv_caches, 2, 64, runner.block_size, runner.device, query_len=2, share=small
    )
    assert shared.logits.data_ptr() == small.logits.data_ptr(), "the logits buffer is the shared one"


# ------------------------------------------------------------------------ whole engines on CPU


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_graphed_verify_is_token_identical_with_padded_proposals(path, reference, async_scheduling):  # noqa: F811
    requests, want, _ = reference
    llm = LLM(path, async_scheduling=async_scheduling, speculative_config=NGRAM, **ARGS)
    install_graphs(llm)
    runner = llm.engine.runner
    assert runner.row_graphs is not None and runner.row_graphs.query_len == K + 1
    log = PathLog(runner)
    got, _ = _run(llm.engine, requests)
    _assert_same(got, want)
    rows = [entry for entry in log.entries if entry[0] == "rows"]
    assert rows, "verify steps replayed the multi-row graphs"
    assert any(min(counts) < K + 1 for _, _, counts in rows), "some sequences had fewer than k drafts: pad rows"
    assert any(bucket > len(counts) for _, bucket, counts in rows), "some batches were padded to a bucket"
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


def test_graphed_draft_model_is_token_identical(path, reference):  # noqa: F811
    """The target as its own draft: the draft's decode steps replay its decode graphs and its
    catch-up steps (1 or 2 new tokens a sequence) its 2-row graphs; outputs equal no speculation."""
    requests, want, _ = reference
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    llm = LLM(path, async_scheduling=False, speculative_config=spec, **ARGS)
    install_graphs(llm)
    draft = llm.engine.proposer.runner
    assert draft.decode_graphs is not None and draft.row_graphs is not None and draft.row_graphs.query_len == 2
    assert draft.decode_graphs.logits.data_ptr() == llm.engine.runner.decode_graphs.logits.data_ptr()
    target_log, draft_log = PathLog(llm.engine.runner), PathLog(draft)
    got, _ = _run(llm.engine, requests)
    _assert_same(got, want)
    assert "rows" in target_log.kinds()
    assert {"decode", "rows"} <= set(draft_log.kinds()), "draft steps replayed both kinds of graphs"
    assert llm.engine.spec_stats.num_accepted_tokens / llm.engine.spec_stats.num_draft_tokens > 0.9
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_step_disabled_by_batch_size_takes_the_path_of_no_speculation(path, method):  # noqa: F811
    """Four sequences of the same length decode together to the end, above disable_by_batch_size=2:
    with speculation graphs installed, every step goes through the same runner path (the same
    decode-graph buckets, the same eager prefill) as an engine without speculation, nothing is
    proposed (no draft forward either) and the outputs are the same."""
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    prompts = [[5 + i, 6, 7, 8, 5 + i, 6, 7, 8, 5] for i in range(4)]
    traces, outputs = [], []
    for config in (None, {**spec, "disable_by_batch_size": 2}):
        llm = LLM(path, speculative_config=config, **ARGS)
        install_graphs(llm)
        engine = llm.engine
        log = PathLog(engine.runner)
        proposals = []
        if engine.proposer is not None:
            assert engine.runner.row_graphs is not None
            propose = engine.proposer.propose
            engine.proposer.propose = lambda batch, f=propose, seen=proposals: seen.append(batch) or f(batch)
            if method == "draft_model":
                draft_log = PathLog(engine.proposer.runner)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_tokens=12), use_tqdm=False)
        outputs.append([o.outputs[0].token_ids for o in outs])
        traces.append(log.entries)
        if engine.proposer is not None:
            assert not proposals and engine.spec_stats.num_drafts == 0
            if method == "draft_model":
                assert not draft_log.entries, "the draft model ran while speculation was disabled"
    assert traces[0] == traces[1]
    assert {entry[0] for entry in traces[0]} == {"eager", "decode"}
    assert outputs[0] == outputs[1]


def test_draft_catch_up_stays_within_the_step_budget(path, reference):  # noqa: F811
    """While the batch is above disable_by_batch_size the draft falls behind; when a sequence
    finishes and speculation resumes, the others' catch-up is one forward of at most
    max_num_batched_tokens tokens in all (before: up to that many per sequence)."""
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": K, "disable_by_batch_size": 2}
    budget = 16
    llm = LLM(path, speculative_config=spec, max_num_batched_tokens=budget, **ARGS)
    draft = llm.engine.proposer.runner
    sizes = []
    execute = draft.execute
    draft.execute = lambda out: sizes.append(out.num_batched_tokens) or execute(out)
    prompts = [[9 + i, 10, 11, 12, 9 + i, 10, 11, 12, 9 + i, 10] for i in range(3)]
    params = [_greedy(max_tokens=4), _greedy(max_tokens=20), _greedy(max_tokens=20)]
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = LLM(path, **ARGS).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert sizes and max(sizes) <= budget, sizes
    assert max(sizes) > 2, "a catch-up of more than the steady 1-2 tokens a sequence happened"
    assert llm.engine.spec_stats.num_drafts > 0
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


# --------------------------------------------------------------- the kernels on the padded layout


def test_triton_attention_on_the_padded_layout_matches_the_real_one():
    """The attention kernels a verify graph launches (prefill/extend with a fixed query length; the
    decode kernel beside it skips every sequence) give the real rows of the padded layout the
    outputs of the unpadded step, and store nothing for pad rows (Triton interpreter on CPU)."""
    pytest.importorskip("triton")
    from quant_kernels import attention_triton
    from quant_kernels.attention_triton import AttentionConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = AttentionConfig(decode_block_n=16, prefill_block_m=16, prefill_block_n=16, min_split_tokens=16)
    gen = torch.Generator().manual_seed(3)
    h, hkv, d, bs, q = 4, 2, 32, 4, 4
    counts, seq_lens, max_model_len = np.array([1, 3, 4]), np.array([6, 9, 12]), 16
    num_blocks, num_seqs, bucket = 16, 3, 4
    tables = torch.randperm(num_blocks - 1, generator=gen)[: num_seqs * 4].view(num_seqs, 4).int() + 1
    key_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).half()
    value_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).half()
    tokens = int(counts.sum())
    qkv = torch.randn(bucket * q, h + 2 * hkv, d, generator=gen).half()  # a row for every static row
    positions = np.concatenate([np.arange(s - n, s) for n, s in zip(counts, seq_lens)])
    seq_of = np.repeat(np.arange(num_seqs), counts)
    slots = (tables[seq_of, positions // bs].long() * bs + torch.from_numpy(positions % bs)).numpy()
    rows = static_rows(counts, q)  # real tokens' rows in the padded layout

    def attend(query, key, value, slot_mapping, tables_, lens, qsl, max_query_len):  # noqa: ANN001, ANN202
        kc, vc = key_cache.clone().to(device), value_cache.clone().to(device)
        dev = [t.to(device) for t in (query, key, value, slot_mapping, tables_, lens, qsl)]
        attention_triton.store_kv(dev[1], dev[2], kc, vc, dev[3])
        out = attention_triton.paged_attention(
            dev[0], kc, vc, dev[4], dev[5], dev[6], max_query_len, max_model_len, d**-0.5, config=small
        )
        return out.cpu(), kc.cpu(), vc.cpu()

    real = qkv[torch.from_numpy(rows)]  # [T, ...]: the real tokens' q / k / v
    want, kc_want, vc_want = attend(
        real[:, :h], real[:, h : h + hkv], real[:, h + hkv :], torch.from_numpy(slots), tables,
        torch.from_numpy(seq_lens), torch.from_numpy(np.concatenate(([0], np.cumsum(counts)))), int(counts.max()),
    )  # fmt: skip
    static_slots = torch.full((bucket * q,), -1, dtype=torch.int64)
    static_slots[torch.from_numpy(rows)] = torch.from_numpy(slots)
    static_tables = torch.zeros(bucket, max_model_len // bs, dtype=torch.int32)
    static_tables[:num_seqs, :4] = tables
    lens = torch.tensor([*seq_lens, q])  # the pad sequence: length q over block 0
    got, kc_got, vc_got = attend(
        qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :], static_slots, static_tables, lens,
        torch.arange(bucket + 1) * q, q,
    )  # fmt: skip
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[torch.from_numpy(rows)].float(), want.float(), atol=2e-3, rtol=2e-3)
    assert torch.equal(kc_got, kc_want) and torch.equal(vc_got, vc_want), "pad rows stored K/V"
    assert tokens == len(rows)


# ---------------------------------------------------------------------------------------- GPU


def _cuda_engine(checkpoint: str, spec, graphs: bool, monkeypatch, **kwargs) -> LLM:  # noqa: ANN001
    """A float32 engine on a fixed small pool, graphs up to 32 sequences (fewer captures)."""
    monkeypatch.setenv(SPEC_GRAPHS_ENV, "1" if graphs else "0")
    return LLM(
        checkpoint,
        device="cuda",
        dtype="float32",
        block_size=16,
        num_kv_blocks=256,
        max_num_seqs=32,
        speculative_config=spec,
        **kwargs,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cuda_graphed_verify_matches_eager_and_no_speculation(path, async_scheduling, monkeypatch):  # noqa: F811
    """Captured verify graphs (n-gram; a draft model with its decode and catch-up graphs too) give
    the greedy tokens and logprobs of the eager verify and of no speculation (float32), replaying
    multi-row graphs with pad rows."""
    from tests.integration.test_spec_decode import _workload

    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    finals = {}
    for name, spec, graphs in (
        ("none", None, False),
        ("ngram-eager", NGRAM, False),
        ("ngram-graphs", NGRAM, True),
        ("draft-graphs", draft, True),
    ):
        llm = _cuda_engine(path, spec, graphs, monkeypatch, async_scheduling=async_scheduling)
        engine = llm.engine
        probe = llm.generate([{"prompt_token_ids": LOOP}], _greedy(), use_tqdm=False)[0].outputs[0]
        requests = [r for r in _workload(probe.token_ids[9], "\n\n") if r[0] != "stop_str"]
        log = PathLog(engine.runner)
        draft_log = PathLog(engine.proposer.runner) if name == "draft-graphs" else None
        finals[name] = _run(engine, requests)[0]
        if graphs:
            assert isinstance(next(iter(engine.runner.row_graphs.graphs.values())), torch.cuda.CUDAGraph)
            assert any(e[0] == "rows" and min(e[2]) < K + 1 for e in log.entries), "padded verify steps replayed"
        else:
            assert engine.runner.row_graphs is None
        if draft_log is not None:
            assert {"decode", "rows"} <= set(draft_log.kinds())
            assert engine.spec_stats.num_accepted_tokens / engine.spec_stats.num_draft_tokens > 0.9
        if spec is not None:
            assert engine.spec_stats.num_accepted_tokens > 0
            assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
        del llm, engine
        torch.cuda.empty_cache()
    for name in ("ngram-eager", "ngram-graphs", "draft-graphs"):
        _assert_same(finals[name], finals["none"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_step_disabled_by_batch_size_replays_the_plain_decode_graphs(path, monkeypatch):  # noqa: F811
    """On the GPU, with speculation graphs captured: a batch above disable_by_batch_size replays the
    same decode-graph buckets as an engine without speculation and gives the same tokens."""
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8, 5 + i, 6, 7, 8, 5]} for i in range(6)]
    traces, outputs = [], []
    for spec in (None, {**NGRAM, "disable_by_batch_size": 4}):
        llm = _cuda_engine(path, spec, True, monkeypatch)
        log = PathLog(llm.engine.runner)
        outs = llm.generate(prompts, _greedy(max_tokens=16), use_tqdm=False)
        outputs.append([o.outputs[0].token_ids for o in outs])
        traces.append(log.entries)
        if spec is not None:
            assert llm.engine.runner.row_graphs is not None and llm.engine.spec_stats.num_drafts == 0
        del llm
        torch.cuda.empty_cache()
    assert traces[0] == traces[1] and "decode" in {e[0] for e in traces[0]}
    assert outputs[0] == outputs[1]


# ------------------------------------------------------------- verify steps beside a prompt (CPU)


def _verify_beside_a_prompt(checkpoint: str, monkeypatch, takes_drafts: bool, cuda: bool = False) -> list[str]:  # noqa: ANN001
    """Run a looping request with n-gram drafts and, once drafts flow, a 40-token prompt whose chunks
    (16-token step budget) land beside its verify steps; assert every request gets the tokens of no
    speculation; return the path each step that verified drafts beside a prompt chunk took."""
    from qserve.engine.engine import PIECEWISE_SPEC_ENV
    from qserve.runner.piecewise_graphs import PIECEWISE_BUCKETS_ENV, PIECEWISE_GRAPHS_ENV

    monkeypatch.setenv(PIECEWISE_GRAPHS_ENV, "1")
    monkeypatch.setenv(PIECEWISE_BUCKETS_ENV, "8,16")
    if takes_drafts:  # the default: unset
        monkeypatch.delenv(PIECEWISE_SPEC_ENV, raising=False)
    else:
        monkeypatch.setenv(PIECEWISE_SPEC_ENV, "0")
    monkeypatch.setenv(SPEC_GRAPHS_ENV, "1")
    newcomer = [9 + (7 * i) % 50 for i in range(40)]
    args = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=256, max_num_seqs=32) if cuda else ARGS
    want = {}
    plain = LLM(checkpoint, async_scheduling=False, max_num_batched_tokens=16, **args)
    for name, prompt in (("loop", LOOP), ("new", newcomer)):
        want[name] = plain.generate([{"prompt_token_ids": prompt}], _greedy(max_tokens=24), use_tqdm=False)[0]
    del plain
    llm = LLM(checkpoint, async_scheduling=False, speculative_config=NGRAM, max_num_batched_tokens=16, **args)
    if not cuda:
        install_graphs(llm)
    engine, runner = llm.engine, llm.engine.runner
    assert runner.piecewise_graphs is not None and runner.piecewise_takes_spec_steps == takes_drafts
    paths: list[tuple[int, int, str]] = []  # (draft tokens, tokens, path) per launch
    taken: list[str] = []
    for name in ("_forward_eager", "_forward_piecewise"):
        original = getattr(runner, name)

        def spy(*args, f=original, kind=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
            taken.append(kind.removeprefix("_forward_"))
            return f(*args, **kwargs)

        setattr(runner, name, spy)
    launch = runner.launch

    def logged(scheduler_output, previous=None):  # noqa: ANN001, ANN202
        before = len(taken)
        step = launch(scheduler_output, previous)
        kind = taken[-1] if len(taken) > before else "graph"
        paths.append((scheduler_output.num_spec_tokens, scheduler_output.num_batched_tokens, kind))
        return step

    runner.launch = logged
    engine.add_request("loop", {"prompt_token_ids": LOOP}, _greedy(max_tokens=24))
    final = {}
    steps, added = 0, False
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 200
        if not added and any(drafts for drafts, _, _ in paths):  # drafts flow: the prompt lands beside a verify
            engine.add_request("new", {"prompt_token_ids": newcomer}, _greedy(max_tokens=24))
            added = True
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    for name in ("loop", "new"):
        assert final[name].outputs[0].token_ids == want[name].outputs[0].token_ids, name
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    beside = [kind for drafts, tokens, kind in paths if drafts and tokens > drafts + 2]
    assert beside, f"a step verified drafts beside a prompt: {paths}"
    return beside


@pytest.mark.parametrize("takes_drafts", [False, True], ids=["eager", "piecewise"])
def test_a_verify_beside_a_prompt_takes_the_piecewise_graphs_when_asked(path, monkeypatch, takes_drafts):  # noqa: F811
    """A step that verifies drafts and also prefills a newcomer's prompt fits no row graph. Without
    the piecewise graphs (QSERVE_PIECEWISE_SPEC=0) it runs eagerly (on the GPU a 14B model's eager
    step, which put n-gram speculation's TTFT p50 at 170 ms against 38 without it at Poisson 4:
    bench/RESULTS.md); by default (the variable unset) it runs through the piecewise graphs
    (StaticReplay stand-ins here). Both give every request the tokens of no speculation."""
    beside = _verify_beside_a_prompt(path, monkeypatch, takes_drafts)
    assert set(beside) == ({"piecewise"} if takes_drafts else {"eager"}), beside


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_verify_beside_a_prompt_replays_the_piecewise_graphs(path, monkeypatch):  # noqa: F811
    """QSERVE_PIECEWISE_SPEC=1 on the GPU: the verify steps beside a prompt chunk replay captured
    piecewise graphs and every request gets the tokens of no speculation (float32)."""
    beside = _verify_beside_a_prompt(path, monkeypatch, True, cuda=True)
    assert set(beside) == {"piecewise"}, beside
    torch.cuda.empty_cache()


def test_the_launch_path_switches_take_1_0_or_unset_and_refuse_anything_else(path, monkeypatch):  # noqa: F811
    """QSERVE_EAGLE_DECODE_GRAPHS and QSERVE_PIECEWISE_SPEC take 1 (on), 0 (off) or unset (their
    default: on since their GPU run); anything else is refused naming the variable (a "true" would
    otherwise silently leave the path off)."""
    from qserve.engine.engine import PIECEWISE_SPEC_ENV, env_switch
    from qserve.runner.piecewise_graphs import PIECEWISE_GRAPHS_ENV

    monkeypatch.delenv("QSERVE_SOME_SWITCH", raising=False)
    assert env_switch("QSERVE_SOME_SWITCH", default=False) is False
    assert env_switch("QSERVE_SOME_SWITCH", default=True) is True
    for value, on in (("0", False), ("1", True), (" 1 ", True)):
        monkeypatch.setenv("QSERVE_SOME_SWITCH", value)
        assert env_switch("QSERVE_SOME_SWITCH", default=not on) is on
    monkeypatch.setenv("QSERVE_SOME_SWITCH", "")
    assert env_switch("QSERVE_SOME_SWITCH", default=True) is True
    monkeypatch.setenv("QSERVE_SOME_SWITCH", "true")
    with pytest.raises(ValueError, match="QSERVE_SOME_SWITCH='true': expected 1"):
        env_switch("QSERVE_SOME_SWITCH", default=True)
    monkeypatch.setenv(PIECEWISE_GRAPHS_ENV, "1")
    monkeypatch.setenv(PIECEWISE_SPEC_ENV, "yes")
    with pytest.raises(ValueError, match="QSERVE_PIECEWISE_SPEC='yes'"):
        LLM(path, speculative_config=NGRAM, **ARGS)
