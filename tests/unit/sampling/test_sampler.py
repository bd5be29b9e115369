from __future__ import annotations

import pytest
import torch

from qserve.runner.sampler import (
    Sampler,
    apply_penalties,
    build_sampling_metadata,
    compute_prompt_logprobs,
)
from qserve.sampling_params import SamplingParams

VOCAB = 64


def _sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    sampler: Sampler | None = None,
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    eos: list[int] | None = None,
):
    rows, vocab = logits.shape
    md = build_sampling_metadata(
        params,
        prompts or [[1, 2, 3]] * rows,
        outputs or [[] for _ in range(rows)],
        eos or [0],
        vocab,
        "cpu",
    )
    return (sampler or Sampler(seed=0))(logits, md)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    sampled, logprobs = _sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert sampled == logits.argmax(-1).tolist()
    assert logprobs == [None] * 8
    assert torch.equal(logits, before)  # caller's logits untouched


def test_top_k_1_equals_greedy() -> None:
    gen = torch.Generator().manual_seed(2)
    params = [SamplingParams(top_k=1, temperature=t, seed=s) for t, s in [(1.0, None), (0.5, 3), (2.0, None), (1.3, 9)]]
    for _ in range(5):
        logits = torch.randn(4, VOCAB, generator=gen) * 3
        assert _sample(logits, params)[0] == logits.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    sampled, _ = _sample(logits, params)
    greedy = logits.argmax(-1).tolist()
    assert [sampled[i] for i in (0, 2, 4)] == [greedy[i] for i in (0, 2, 4)]


def test_seeded_rows_independent_of_batch() -> None:
    """Same (seed, index, logits) -> same token, alone or among 7 other rows."""
    gen = torch.Generator().manual_seed(4)
    target = SamplingParams(seed=1234, temperature=0.9, top_p=0.95)
    others = [
        SamplingParams(seed=7),
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=99, top_k=5),
        SamplingParams(temperature=1.5),
        SamplingParams(seed=1235),
        SamplingParams(min_p=0.1),
    ]
    rows = [torch.randn(1, VOCAB, generator=gen) for _ in range(6)]  # [1, V] each
    alone_sampler, batch_sampler = Sampler(seed=0), Sampler(seed=42)
    alone_out: list[int] = []
    batch_out: list[int] = []
    other_seed_out: list[int] = []
    for step, row in enumerate(rows):
        alone, _ = _sample(row, [target], alone_sampler, outputs=[alone_out])
        other, _ = _sample(row, [target.clone(seed=4321)], alone_sampler, outputs=[other_seed_out])
        batch_logits = torch.randn(8, VOCAB, generator=gen)  # [8, V]
        pos = step % 8
        batch_logits[pos] = row[0]
        params = others[:pos] + [target] + others[pos:]
        outputs = [[5] * step for _ in range(8)]
        outputs[pos] = batch_out
        batch, _ = _sample(batch_logits, params, batch_sampler, outputs=outputs)
        alone_out.append(alone[0])
        other_seed_out.append(other[0])
        batch_out.append(batch[pos])
    assert alone_out == batch_out
    assert other_seed_out != alone_out  # the seed matters
    assert len(set(alone_out)) > 1  # the index matters (flat logits: draws vary per step)


def test_unseeded_reproducible_from_engine_seed() -> None:
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams()] * 16
    a = [_sample(logits, params, s)[0] for s in [Sampler(seed=11)] for _ in range(3)]
    sampler = Sampler(seed=11)
    b = [_sample(logits, params, sampler)[0] for _ in range(3)]
    assert a == b
    state = torch.random.get_rng_state()
    _sample(logits, params, Sampler(seed=12))
    assert torch.equal(state, torch.random.get_rng_state())  # no global RNG use


BASE = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])  # [6]
DRAWS = 20000


def _frequencies(params: SamplingParams) -> torch.Tensor:
    logits = BASE.expand(DRAWS, -1).clone()  # [DRAWS, 6]
    sampled, _ = _sample(logits, [params] * DRAWS, Sampler(seed=3), prompts=[[]] * DRAWS)
    return torch.bincount(torch.tensor(sampled), minlength=6).float() / DRAWS


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_distribution(temperature: float) -> None:
    freq = _frequencies(SamplingParams(temperature=temperature))
    assert torch.allclose(freq, torch.softmax(BASE / temperature, -1), atol=0.015)


def test_top_k_distribution() -> None:
    freq = _frequencies(SamplingParams(top_k=2))
    assert freq[2:].sum() == 0
    assert torch.allclose(freq[:2], torch.softmax(BASE[:2], -1), atol=0.015)


def test_top_p_distribution() -> None:
    probs = torch.softmax(BASE, -1)  # [0.40, 0.24, 0.15, 0.09, 0.05, 0.02] roughly
    freq = _frequencies(SamplingParams(top_p=0.7))
    # Smallest prefix with mass >= 0.7 is tokens 0..2 (0.40 + 0.24 < 0.7 <= + 0.15).
    assert probs[:2].sum() < 0.7 <= probs[:3].sum()
    assert freq[3:].sum() == 0
    assert torch.allclose(freq[:3], probs[:3] / probs[:3].sum(), atol=0.015)


def test_min_p_distribution() -> None:
    probs = torch.softmax(BASE, -1)
    freq = _frequencies(SamplingParams(min_p=0.3))
    kept = probs >= 0.3 * probs.max()
    assert kept.tolist() == [True, True, True, False, False, False]
    assert freq[~kept].sum() == 0
    assert torch.allclose(freq[kept], probs[kept] / probs[kept].sum(), atol=0.015)


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0]])  # [1, 5]
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)]
    md = build_sampling_metadata(params, [[0, 4]], [[2, 2, 3]], [1], 5, "cpu")
    # repetition (seen: 0, 2, 3, 4): 2/2, -1, 0.5/2, 1/2, -2*2 = [1, -1, 0.25, 0.5, -4]
    # frequency (counts t2=2, t3=1) and presence (t2, t3): t2 0.25-0.5-0.5, t3 0.5-0.25-0.5
    expected = torch.tensor([[1.0, -1.0, -0.75, -0.25, -4.0]])
    assert torch.allclose(apply_penalties(logits.clone(), md), expected)
    # Penalties change the greedy choice: logits where the repeated token would win.
    logits = torch.tensor([[1.0, 1.2, 0.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    assert _sample(logits, [greedy], outputs=[[1]], prompts=[[]])[0] == [0]
    assert _sample(logits, [SamplingParams(temperature=0.0)], outputs=[[1]], prompts=[[]])[0] == [1]


def test_penalties_only_on_their_rows() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=1.5)] + [
        SamplingParams(temperature=0.0)
    ]
    md = build_sampling_metadata(params, [[1, 2], [3], []], [[4], [5, 6], [7]], [0], VOCAB, "cpu")
    out = apply_penalties(logits.clone(), md)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert not torch.equal(out[1], logits[1])


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0  # eos
    logits[0, 7] = 9.0  # a stop token id
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7])]
    assert _sample(logits, params, outputs=[[5, 5]])[0] not in ([0], [7])
    assert _sample(logits, params, outputs=[[5, 5, 5]])[0] == [0]
    # ignore_eos: eos is not a stop, so it is not masked either (vLLM).
    params = [SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)]
    assert _sample(logits, params, outputs=[[5]])[0] == [0]
    # Several eos ids (e.g. from generation_config.json) are all masked; random rows too.
    logits[0, 9] = 10.0
    params = [SamplingParams(min_tokens=2, stop_token_ids=[7], seed=1)] * 50
    sampled, _ = _sample(logits.expand(50, -1).clone(), params, eos=[0, 9], outputs=[[]] * 50)
    assert not {0, 7, 9} & set(sampled)


def test_logprobs_layout_raw_logprobs() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(8)) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.8, logprobs=5, seed=3),
    ]
    sampled, logprobs = _sample(logits, params, outputs=[[10, 11], [], [], []])
    raw = torch.log_softmax(logits, -1)  # raw = before penalties / temperature
    top_vals, top_ids = raw.topk(5, -1)

    def rank(r: int, t: int) -> int:
        return int((raw[r] > raw[r, t]).sum()) + 1

    lp0 = logprobs[0]
    assert lp0 is not None and len(lp0.token_ids) == 4
    assert lp0.token_ids[0] == sampled[0] and lp0.ranks[0] == rank(0, sampled[0])
    assert lp0.token_ids[1:] == top_ids[0, :3].tolist() and lp0.ranks[1:] == [1, 2, 3]
    assert torch.allclose(torch.tensor(lp0.logprobs), raw[0, lp0.token_ids])
    assert logprobs[1] is None
    lp2 = logprobs[2]
    assert lp2 is not None and lp2.token_ids == [sampled[2]] and lp2.ranks == [1]
    assert lp2.logprobs[0] == pytest.approx(float(raw[2, sampled[2]]), abs=1e-6)
    lp3 = logprobs[3]
    assert lp3 is not None and len(lp3.token_ids) == 6 and lp3.ranks == [rank(3, sampled[3]), 1, 2, 3, 4, 5]
    assert lp3.token_ids[1:] == top_ids[3].tolist()
    assert torch.allclose(torch.tensor(lp3.logprobs[1:]), top_vals[3])


def test_prompt_logprobs() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(9))  # [T, V]
    targets = torch.tensor([3, 17, 0, 63, 8])
    raw = torch.log_softmax(logits, -1)
    out = compute_prompt_logprobs(logits, targets, k=0)
    assert len(out) == 5
    for t, entry in enumerate(out):
        assert entry.token_ids == [int(targets[t])]
        assert entry.logprobs[0] == pytest.approx(float(raw[t, targets[t]]), abs=1e-6)
        assert entry.ranks == [int((raw[t] > raw[t, targets[t]]).sum()) + 1]
    out2 = compute_prompt_logprobs(logits, targets, k=2)
    assert all(len(e.token_ids) == 3 and e.ranks[1:] == [1, 2] for e in out2)
    assert out2[0].token_ids[1:] == raw[0].topk(2).indices.tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_min_tokens_and_penalties_leave_callers_logits_untouched(temperature: float) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = [SamplingParams(temperature=temperature, min_tokens=5, stop_token_ids=[3], seed=1)] * 2
    params += [SamplingParams(temperature=temperature, repetition_penalty=1.5, seed=2)] * 2
    _sample(logits, params, outputs=[[1]] * 4)
    assert torch.equal(logits, before)
    _sample(logits[:2], params[:2], outputs=[[1]] * 2)  # min_tokens only: the mask needs its own copy
    assert torch.equal(logits, before)


def test_logit_bias_and_grammar_masks_reach_rows_past_the_first_chunk() -> None:
    """Batches wider than one sampler chunk are sampled chunk by chunk: the per-row logit_bias and
    grammar bitmask must follow their rows into later chunks (they were dropped there)."""
    from qserve.runner.sampler import SAMPLER_CHUNK_ROWS

    rows = SAMPLER_CHUNK_ROWS + 10
    biased, masked = SAMPLER_CHUNK_ROWS + 3, SAMPLER_CHUNK_ROWS + 7
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(11))
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(rows)]  # not all greedy: chunked
    params[biased] = SamplingParams(temperature=1.0, seed=1, logit_bias={5: 100.0})
    allowed = 17
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    bitmask[0, allowed // 32] = 1 << (allowed % 32)
    md = build_sampling_metadata(
        params,
        [[1, 2, 3]] * rows,
        [[] for _ in range(rows)],
        [0],
        VOCAB,
        "cpu",
        token_bitmask=([masked], bitmask.numpy()),
    )
    for _ in range(3):
        sampled, _ = Sampler(seed=0)(logits, md)
        assert sampled[biased] == 5
        assert sampled[masked] == allowed
