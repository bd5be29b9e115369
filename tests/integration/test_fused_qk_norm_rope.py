"""QSERVE_FUSED_QK_NORM_ROPE (opt-in): a q/k-norm model's q_norm, k_norm and rotary as one op.

On CPU both sides run the reference (``quant_kernels.reference_elementwise``: the norms, then the
rotary), so results must be equal bit for bit: these tests check the wiring, not the kernel
(tests/kernels/test_elementwise.py checks that against the reference, and on the GPU against the three
launches it replaces). ``RotaryEmbedding.forward(..., qk_norm=...)`` takes the fused op only where the
rotation is the plain one over whole heads, and gives the unfused results everywhere; the decoder takes
it on a tiny Qwen3 with the switch on and not with it off; a bad value is refused, naming the variable.
"""

from __future__ import annotations

import pytest
import torch

from qserve.config import RopeConfig
from qserve.layers.rotary import RotaryEmbedding
from qserve.model.llama import FUSED_QK_NORM_ROPE_ENV
from quant_kernels import elementwise_ops

EPS = 1e-6
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 47))]


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    """Counts the calls of the op ``owner.name`` from now on: one entry per call, its first argument's
    tokens (its leading dim)."""
    calls: list[int] = []
    real = getattr(owner, name)

    def counted(first, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - the op's own signature
        calls.append(first.shape[0])
        return real(first, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """Counts the calls of ``elementwise_ops.qk_norm_rotary_embedding`` (one entry per call: its tokens)."""
    return count_calls(monkeypatch, elementwise_ops, "qk_norm_rotary_embedding")


# (kwargs of RotaryEmbedding, whether the fused op serves it)
ROTARIES = {
    "plain": (dict(), True),
    "ntk tables": (dict(num_ntk_tables=2), True),
    "partial": (dict(rotary_dim=16), False),
    "interleaved, permuted per step": (dict(interleaved=True), False),
    "logn": (dict(logn_seq_length=8), False),
}


@pytest.mark.parametrize("name", list(ROTARIES))
def test_rotary_with_qk_norm_equals_norms_then_rotary(name, fused_calls) -> None:
    kwargs, fused = ROTARIES[name]
    t, hq, hk, d, max_positions = 5, 4, 2, 32, 64
    rotary = RotaryEmbedding(RopeConfig("default", 10000.0), d, max_positions, **kwargs)
    gen = torch.Generator().manual_seed(1)
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 3).bfloat16()  # [T, (Hq + 2 Hk) D]
    query, key = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    q_weight, k_weight = torch.randn(d, generator=gen).bfloat16(), torch.randn(d, generator=gen).bfloat16()
    positions = torch.tensor([40, 3, 0, 17, 63])
    ntk = torch.tensor([0, 1, 1, 0, 1]) if rotary.num_ntk_tables > 1 else None  # [T]: each token's table
    got = rotary(positions, query, key, ntk, qk_norm=(q_weight, k_weight, EPS))
    want = rotary(
        positions, elementwise_ops.rms_norm(query, q_weight, EPS), elementwise_ops.rms_norm(key, k_weight, EPS), ntk
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    assert fused_calls == ([t] if fused else []), name


def test_rotary_with_qk_norm_on_windows(fused_calls) -> None:
    """The quantizer's ``[B, T, heads, D]`` windows: the norms go with the flattened tokens."""
    rotary = RotaryEmbedding(RopeConfig("default", 10000.0), 16, 32)
    gen = torch.Generator().manual_seed(2)
    query, key = torch.randn(2, 3, 4, 16, generator=gen), torch.randn(2, 3, 2, 16, generator=gen)
    q_weight, k_weight = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    positions = torch.arange(3)
    got = rotary(positions, query, key, qk_norm=(q_weight, k_weight, EPS))
    want = rotary(
        positions, elementwise_ops.rms_norm(query, q_weight, EPS), elementwise_ops.rms_norm(key, k_weight, EPS)
    )
    assert got[0].shape == query.shape and got[1].shape == key.shape
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert fused_calls == [6]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

    model = make_tiny_model("Qwen3ForCausalLM", seed=3)  # 2 layers, 4 q / 2 kv heads of 16
    return str(save_tiny_checkpoint(model, tmp_path_factory.mktemp("qwen3")))


def _generate(path: str) -> list[tuple[list[int], list[float]]]:
    from qserve import LLM, SamplingParams

    llm = LLM(path, device="cpu", dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    result = []
    for prompt, output in zip(PROMPTS, outputs):
        prompt_logprobs = [output.prompt_logprobs[i][tok].logprob for i, tok in enumerate(prompt) if i > 0]
        completion = output.outputs[0]
        logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)]
        result.append((completion.token_ids, prompt_logprobs + logprobs))
    return result


def test_switch_gives_the_same_outputs_on_tiny_qwen3(tiny_qwen3, fused_calls, monkeypatch) -> None:
    """Off ("0") the decoder never calls the fused op; on (unset: the default, and "1"), every layer of
    every forward does, and tokens and logprobs are the same as off."""
    monkeypatch.setenv(FUSED_QK_NORM_ROPE_ENV, "0")
    off = _generate(tiny_qwen3)
    assert not fused_calls
    monkeypatch.delenv(FUSED_QK_NORM_ROPE_ENV, raising=False)
    unset = _generate(tiny_qwen3)
    assert fused_calls and len(fused_calls) % 2 == 0, fused_calls  # each forward: both layers
    fused_calls.clear()
    monkeypatch.setenv(FUSED_QK_NORM_ROPE_ENV, "1")
    on = _generate(tiny_qwen3)
    assert fused_calls and len(fused_calls) % 2 == 0, fused_calls
    assert on == off == unset


def test_bad_switch_value_is_refused(tiny_qwen3, monkeypatch) -> None:
    from qserve import LLM

    monkeypatch.setenv(FUSED_QK_NORM_ROPE_ENV, "true")
    with pytest.raises(ValueError, match=FUSED_QK_NORM_ROPE_ENV):
        LLM(tiny_qwen3, device="cpu", dtype="bfloat16")
