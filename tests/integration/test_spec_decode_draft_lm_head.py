"""speculative_config ``"draft_lm_head": "int4"``: an EAGLE head drafts through a 4-bit round-to-nearest
copy of the lm_head it scores with (qserve.spec_decode.draft_lm_head). Greedy outputs stay token-identical
to no speculation (the target verifies with its own lm_head); each draft is the argmax of the copy's
dequantized logits; an oracle head keeps its drafts accepted (a wrong copy collapses that); the copy's
bytes count in the memory plan and in ``qserve plan``; values and methods it does not apply to are refused."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from qserve import LLM
from qserve.layers.quant_methods import tensor_nbytes
from qserve.quantize.quantizer import quantize_rtn
from qserve.spec_decode import draft_lm_head
from qserve.spec_decode.config import parse_speculative_config
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


def test_the_copy_is_round_to_nearest_per_group() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40_000, 256, generator=gen).half()  # [V, H]: more rows than one chunk
    packed = draft_lm_head.pack_int4_rtn(weight)
    assert (packed.in_features, packed.out_features, packed.group_size) == (256, 40_000, 128)
    from quant_kernels.reference import w4a16_matmul

    eye = torch.eye(256, dtype=torch.float16)
    got = w4a16_matmul(eye, packed).float()  # [H, V]: the dequantized copy
    want = quantize_rtn(weight, 4, 128, sym=False).dequantize()  # [H, V]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    assert (got - weight.float().T).abs().max() < 0.5 * weight.float().abs().max() / 7  # within half a step
    groups = 256 // 128
    assert tensor_nbytes(packed) == 40_000 * 256 // 2 + groups * 40_000 * (2 + 1)  # codes, fp16 scales, uint8 zeros
    # on the GPU the kernels' layout keeps the zeros at 16 bits too: what qserve plan counts
    assert draft_lm_head.planned_bytes(40_000, 256, torch.float16) == 40_000 * 256 // 2 + groups * 40_000 * (2 + 2)
    # more rows than one kernel call takes (the dispatch would rebuild the dense weight above them): sliced
    x = torch.randn(300, 256, generator=gen).half()  # [R, H]
    rows = draft_lm_head.MAX_ROWS_PER_CALL
    assert x.shape[0] > rows
    torch.testing.assert_close(draft_lm_head.logits(x, packed), w4a16_matmul(x, packed).float())
    assert draft_lm_head.planned_bytes(40_000, 256, torch.float32) == draft_lm_head.planned_bytes(
        40_000, 256, torch.float16
    )  # a float32 model's copy multiplies in float16
    assert draft_lm_head.group_size_for(64) == 64 and draft_lm_head.group_size_for(5120) == 128
    with pytest.raises(ValueError, match="hidden size 36 is not a multiple of 8"):
        draft_lm_head.group_size_for(36)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_int4_drafts_keep_the_outputs_and_are_the_copys_argmax(path, heads, reference, method):  # noqa: F811
    requests, want, _ = reference
    llm = LLM(path, speculative_config=_spec(heads, method, draft_lm_head="int4"), **ARGS)
    engine = llm.engine
    head = engine._eagle_head
    assert head.draft_lm_head is not None
    got, _ = _run(engine, requests)
    _assert_same(got, want)
    assert engine.spec_stats.num_draft_tokens > 0
    planned = {
        lm_head: LLM(
            path, gpu_memory_budget="256MiB", speculative_config=_spec(heads, method, draft_lm_head=lm_head), **ARGS
        ).engine
        for lm_head in ("target", "int4")
    }
    # each draft: the argmax of the dequantized copy's logits (EAGLE-3: mapped through d2t), which is not
    # the dense lm_head's argmax on every row (so the check tells the two apart)
    x = torch.randn(256, head.config.model.hidden_size, generator=torch.Generator().manual_seed(1)).to(
        head.fc.weight.dtype if head.fc is not None else torch.float32
    )
    dense_head = planned["target"]._eagle_head
    dense = dense_head.lm_head.weight if method == "eagle3" else engine.model.lm_head.weight  # [V, H]
    copy = quantize_rtn(dense.float(), 4, draft_lm_head.group_size_for(dense.shape[1]), sym=False)
    logits = x.half().float() @ copy.dequantize()  # [256, V]: the copy multiplies in float16
    if method == "eagle":
        logits[:, head.valid_vocab_size :] = float("-inf")
        expected = logits.argmax(-1)
    else:
        logits.masked_fill_(head._invalid_drafts, float("-inf"))
        ids = logits.argmax(-1)
        expected = ids + head.d2t[ids]
    got = head.draft_tokens(x)
    assert torch.equal(got, expected)
    assert not torch.equal(got, dense_head.draft_tokens(x)), "the copy's drafts differ from the dense lm_head's"
    # the copy counts in the plan (EAGLE-3: in place of its dense lm_head), and in the draft cost
    extra = planned["int4"].memory_plan.weights_bytes - planned["target"].memory_plan.weights_bytes
    replaced = dense.numel() * dense.element_size() if method == "eagle3" else 0
    assert extra == head.draft_lm_head_bytes() - replaced and head.draft_lm_head_bytes() > 0
    assert head.lm_head is None  # EAGLE-3's dense one is gone (EAGLE borrows the target's)
    assert planned["int4"]._eagle_head.weight_bytes() < dense_head.weight_bytes()


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_oracle_head_keeps_its_drafts_accepted_with_int4(walk, method):  # noqa: F811
    target, oracle, perm = walk
    llm = LLM(target, speculative_config=_spec(oracle, method, draft_lm_head="int4"), **ARGS)
    prompts = [{"prompt_token_ids": [PERM_FIRST + s for s in (3, 9, 17, 40)]}]
    outputs = llm.generate(prompts, _greedy(max_tokens=30), use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == walk_tokens(perm, 40, 30)
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.95, stats.num_accepted_tokens / stats.num_draft_tokens


def planned_draft_bytes(path: str, spec: dict, capsys: pytest.CaptureFixture) -> int:  # noqa: F811
    """``qserve plan --json``'s draft_weights_bytes for the target ``path`` under ``spec``."""
    from qserve.commands import plan

    parser = argparse.ArgumentParser()
    plan.register(parser)
    args = [path, "--gpu-memory-budget", "256MiB", "--json", "--speculative-config", json.dumps(spec)]
    assert plan.run(parser.parse_args(args)) == 0
    return json.loads(capsys.readouterr().out)["draft_weights_bytes"]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_qserve_plan_counts_the_copy(path, heads, method, capsys):  # noqa: F811
    from qserve.model.registry import read_model_config
    from qserve.spec_decode.eagle_config import read_eagle_config

    config = json.loads((Path(path) / "config.json").read_text())
    extra = planned_draft_bytes(path, _spec(heads, method, draft_lm_head="int4"), capsys)
    extra -= planned_draft_bytes(path, _spec(heads, method), capsys)
    hidden = config["hidden_size"]
    if method == "eagle":  # beside the target's lm_head
        want = draft_lm_head.planned_bytes(config["vocab_size"], hidden, torch.float16)
    else:  # in place of the head's own
        vocab = read_eagle_config(heads[method], method, read_model_config(path)).draft_vocab_size
        want = draft_lm_head.planned_bytes(vocab, hidden, torch.float16) - vocab * hidden * 2
    assert extra == want != 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"method": "eagle", "model": "h", "draft_lm_head": "int8"}, "draft_lm_head must be one of target, int4"),
        ({"method": "ngram", "draft_lm_head": "int4"}, "draft_lm_head 'int4' applies to EAGLE heads .* not method 'ngram'"),
        ({"method": "draft_model", "model": "d", "draft_lm_head": "int4"}, "not method 'draft_model'"),
        ({"method": "eagle", "model": "h", "draft_layers": "int8"}, "draft_layers must be one of checkpoint, int4"),
        ({"method": "ngram", "draft_layers": "int4"}, "draft_layers 'int4' applies to EAGLE heads .* not method 'ngram'"),
        ({"method": "draft_model", "model": "d", "draft_layers": "int4"}, "not method 'draft_model'"),
    ],
)  # fmt: skip
def test_draft_options_they_cannot_apply_are_refused(extra: dict, message: str) -> None:
    """``draft_lm_head`` and ``draft_layers`` (the 4-bit draft layers' own file shares this check)."""
    with pytest.raises(ValueError, match=message):
        parse_speculative_config({"num_speculative_tokens": 2, **extra})
    default = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2})
    assert (default.draft_lm_head, default.draft_layers) == ("target", "checkpoint")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cuda_int4_draft_lm_head(path, heads, walk, async_scheduling):  # noqa: F811
    """On the GPU with the default graphs (decode, verify, the head's drafting and catch-up): random heads
    drafting through the 4-bit copy keep the greedy outputs of no speculation (float32), oracle heads keep
    > 95% of their drafts, every page comes back."""
    gpu = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=256, async_scheduling=async_scheduling)

    def make_llm(target: str, spec: dict | None) -> LLM:
        return LLM(target, speculative_config=spec and {**spec, "draft_lm_head": "int4"}, **gpu)

    def drafts_through_the_copy(llm: LLM) -> None:
        assert llm.engine._eagle_head.draft_lm_head is not None

    _assert_cuda_heads_keep_the_outputs(path, heads, make_llm, drafts_through_the_copy)
    _assert_oracle_heads_walk(walk, make_llm)
