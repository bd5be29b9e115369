"""QSERVE_FUSED_ROPE_KV_STORE (opt-in): the rotary's launch also writes the step's keys and values into a
model-dtype paged cache, so the attention launches no ``store_kv``.

On CPU both sides run the reference (the rotary, then ``reference.store_kv``), so results are equal bit for
bit: these tests check the wiring (tests/kernels/test_elementwise.py checks the kernel against the reference
in the interpreter, and on the GPU against the two launches it replaces). ``RotaryEmbedding`` takes a store
only where its rotation is one op over whole heads; the decoder hands it one with the switch on, for a
cache in the activations' dtype, and the attention then stores nothing; fp8 caches keep the attention's
store; a bad value is refused, naming the variable.
"""

from __future__ import annotations

import pytest
import torch

from qserve.config import RopeConfig
from qserve.layers.rotary import RotaryEmbedding
from qserve.model.llama import FUSED_ROPE_KV_STORE_ENV
from quant_kernels import attention_ops, reference
from quant_kernels.kv_store import KVStore
from tests.integration.test_fused_qk_norm_rope import EPS, ROTARIES, _generate, count_calls
from tests.integration.test_spec_decode import path  # noqa: F401 - fixture
from tests.integration.test_spec_decode_eagle import heads  # noqa: F401 - fixture

BLOCKS, BLOCK_SIZE = 6, 4


def _case(hk: int = 2, d: int = 32, t: int = 5, dtype: torch.dtype = torch.bfloat16):  # noqa: ANN202
    gen = torch.Generator().manual_seed(4)
    hq = 2 * hk
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 3).to(dtype)  # [T, (Hq + 2 Hk) D]
    query, key, value = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return query.view(t, hq, d), key.view(t, hk, d), value.view(t, hk, d)  # strided views, as the decoder's


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rotary", "qk-norm-rotary"])
@pytest.mark.parametrize("name", list(ROTARIES))
def test_rotary_with_a_kv_store_equals_rotary_then_store_kv(name, qk_norm) -> None:
    kwargs, fusable = ROTARIES[name]
    query, key, value = _case()
    d = query.shape[-1]
    rotary = RotaryEmbedding(RopeConfig("default", 10000.0), d, 64, **kwargs)
    assert rotary.stores_kv == fusable, name
    positions = torch.tensor([40, 3, 0, 17, 63])
    ntk = torch.tensor([0, 1, 1, 0, 1]) if rotary.num_ntk_tables > 1 else None
    norm = (torch.linspace(0.5, 1.5, d).bfloat16(), torch.linspace(1.5, 0.5, d).bfloat16(), EPS) if qk_norm else None
    slots = torch.tensor([5, -1, 0, 23, 9])  # a pad row (-1) stores nothing
    caches = [torch.full((BLOCKS, BLOCK_SIZE, key.shape[1], d), 7.0, dtype=key.dtype) for _ in range(2)]
    store = KVStore(value, caches[0], caches[1], slots)
    if not fusable:
        with pytest.raises(ValueError, match="kv_store"):
            rotary(positions, query, key, ntk, qk_norm=norm, kv_store=store)
        return
    got = rotary(positions, query, key, ntk, qk_norm=norm, kv_store=store)
    want = rotary(positions, query, key, ntk, qk_norm=norm)
    want_caches = [torch.full_like(c, 7.0) for c in caches]
    reference.store_kv(want[1], value, want_caches[0], want_caches[1], slots)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1]), name


def test_a_kv_store_the_fused_op_cannot_do_is_refused() -> None:
    query, key, value = _case()
    rotary = RotaryEmbedding(RopeConfig("default", 10000.0), 32, 64)
    positions, slots = torch.arange(5), torch.arange(5)
    cache = torch.zeros((BLOCKS, BLOCK_SIZE, 2, 32), dtype=torch.bfloat16)
    fp8 = torch.zeros((BLOCKS, BLOCK_SIZE, 2, 32), dtype=torch.float8_e4m3fn)
    for store, what in (
        (KVStore(value, fp8, fp8, slots), "only a model-dtype cache"),
        (KVStore(value[:4], cache, cache, slots), "value"),
        (KVStore(value, cache, cache, slots[:3]), "slot_mapping"),
        (KVStore(value, cache[:, :, :1], cache[:, :, :1], slots), "key_cache"),
    ):
        with pytest.raises(ValueError, match=what):
            rotary(positions, query, key, kv_store=store)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

    return {
        arch: str(save_tiny_checkpoint(make_tiny_model(arch, seed=3), tmp_path_factory.mktemp(arch)))
        for arch in ("Qwen3ForCausalLM", "LlamaForCausalLM")
    }


@pytest.fixture
def store_calls(monkeypatch) -> list[int]:
    """Counts ``attention_ops.store_kv``'s calls (one entry each: its tokens)."""
    return count_calls(monkeypatch, attention_ops, "store_kv")


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_switch_gives_the_same_outputs_and_no_store_launch(tiny_models, store_calls, arch, monkeypatch) -> None:
    """Off ("0") every layer's attention stores; on (unset: the default, or "1") none does, and tokens and
    logprobs are those of off (a q/k-norm model and a plain one)."""
    monkeypatch.setenv(FUSED_ROPE_KV_STORE_ENV, "0")
    off = _generate(tiny_models[arch])
    assert store_calls
    for on_value in (None, "1"):
        if on_value is None:
            monkeypatch.delenv(FUSED_ROPE_KV_STORE_ENV, raising=False)
        else:
            monkeypatch.setenv(FUSED_ROPE_KV_STORE_ENV, on_value)
        store_calls.clear()
        on = _generate(tiny_models[arch])
        assert not store_calls, on_value
        assert on == off


def test_an_fp8_cache_keeps_the_attentions_store(tiny_models, store_calls, monkeypatch) -> None:
    from qserve import LLM, SamplingParams

    monkeypatch.setenv(FUSED_ROPE_KV_STORE_ENV, "1")
    llm = LLM(tiny_models["LlamaForCausalLM"], device="cpu", dtype="bfloat16", kv_cache_dtype="fp8")
    llm.generate([{"prompt_token_ids": [5, 17, 42]}], SamplingParams(temperature=0, max_tokens=3))
    assert store_calls


def test_bad_switch_value_is_refused(tiny_models, monkeypatch) -> None:
    from qserve import LLM

    monkeypatch.setenv(FUSED_ROPE_KV_STORE_ENV, "on")
    with pytest.raises(ValueError, match=FUSED_ROPE_KV_STORE_ENV):
        LLM(tiny_models["LlamaForCausalLM"], device="cpu", dtype="bfloat16")


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_eagle_heads_attention_stores_in_the_rotary_too(path, heads, store_calls, method, monkeypatch) -> None:  # noqa: F811
    """An EAGLE head's layers store in the rotary's launch too: EAGLE-1's through the decoder layer, EAGLE-3's
    first through ``Attention.forward`` (not the decoder layer's halves); same tokens, same drafts taken."""
    from qserve import LLM
    from tests.integration.test_spec_decode import ARGS, LOOP, _greedy
    from tests.integration.test_spec_decode_eagle import _spec

    def run() -> tuple[list[int], int, int]:
        llm = LLM(path, speculative_config=_spec(heads, method), **ARGS)
        out = llm.generate([{"prompt_token_ids": LOOP}], _greedy(max_tokens=20), use_tqdm=False)[0].outputs[0]
        stats = llm.engine.spec_stats
        return out.token_ids, stats.num_draft_tokens, stats.num_accepted_tokens

    monkeypatch.setenv(FUSED_ROPE_KV_STORE_ENV, "0")
    off = run()
    assert store_calls and off[1] > 0
    monkeypatch.delenv(FUSED_ROPE_KV_STORE_ENV, raising=False)  # on by default
    store_calls.clear()
    assert run() == off
    assert not store_calls
