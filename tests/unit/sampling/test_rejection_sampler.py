"""Rejection sampling of draft tokens (``qserve.runner.rejection_sampler``) keeps the target
distribution exactly: on a 6-token vocabulary, with temperature, top-k, top-p, penalties and
logit_bias, the first emitted token follows the sampler's own distribution and the token after an
accepted draft follows the next row's (chi-square, fixed seeds), while two classic wrong rules
(resampling from p instead of the residual; accepting every draft) fail the same bound. Greedy
rows keep exactly the argmax; a row without a draft gives the sampler's own token for a seed."""

from __future__ import annotations

import pytest
import torch

import qserve.runner.rejection_sampler as rs
from qserve.runner.rejection_sampler import accepted_tokens, verify_rows
from qserve.runner.sampler import Sampler, build_sampling_metadata
from qserve.sampling_params import SamplingParams

VOCAB = 6
NUM_TRIALS = 10_000
# chi-square bound for at most 5 degrees of freedom: P(X > 30) < 2e-5 under the right rule; the
# seeds are fixed, so the test is deterministic either way.
CHI2_BOUND = 30.0
LOGITS = torch.tensor(
    [[1.0, 0.6, 0.4, -0.3, 0.1, -2.0], [0.2, -0.5, 1.1, 0.3, -0.2, 0.0]], dtype=torch.float32
)  # [2, V]: row 0 after the prompt, row 1 after the draft
DRAFT = 1
PARAMS = SamplingParams(
    temperature=0.9, top_k=5, top_p=0.97, repetition_penalty=1.3, presence_penalty=0.2, logit_bias={2: 0.4}
)
PROMPT = [0, 4]


def _target_probs(sampler: Sampler, row: int, output: list[int]) -> torch.Tensor:
    """The sampler's distribution of one row (what sampling without speculation draws from)."""
    md = build_sampling_metadata([PARAMS], [PROMPT], [output], [], VOCAB, "cpu")
    return sampler.random_probs(sampler.process_logits(LOGITS[row : row + 1].clone(), md), md)[0]  # [V]


def _chi2(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=VOCAB).double()
    expected = probs.double() * len(tokens)
    assert (counts[expected == 0] == 0).all(), "a token the target never samples was emitted"
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _run(monkeypatch, device: str = "cpu") -> tuple[list[int], list[int]]:  # noqa: ANN001
    """NUM_TRIALS sequences with the one draft: (first emitted tokens, tokens after an accepted draft)."""
    monkeypatch.setattr(rs, "SAMPLER_CHUNK_ROWS", 10**9)  # one chunk: the rule, not the chunking, is tested
    sampler = Sampler(seed=1234)
    md = build_sampling_metadata(
        [PARAMS] * (2 * NUM_TRIALS), [PROMPT] * (2 * NUM_TRIALS), [[], [DRAFT]] * NUM_TRIALS, [], VOCAB, device
    )
    logits = LOGITS.repeat(NUM_TRIALS, 1).to(device)  # [2 T, V]
    drafts = torch.tensor([DRAFT, -1] * NUM_TRIALS, dtype=torch.int64, device=device)
    targets, accepted = verify_rows(sampler, logits, md, drafts)
    emitted = accepted_tokens([[DRAFT]] * NUM_TRIALS, targets.tolist(), accepted.tolist())
    return [e[0] for e in emitted], [e[1] for e in emitted if len(e) == 2]


def test_emitted_tokens_follow_the_target_distribution(monkeypatch):
    sampler = Sampler()
    p0, p1 = _target_probs(sampler, 0, []), _target_probs(sampler, 1, [DRAFT])
    assert 0.15 < float(p0[DRAFT]) < 0.6, "the draft must be accepted sometimes and rejected sometimes"
    assert (p0 == 0).any(), "top-k / top-p should cut a token"
    first, after_draft = _run(monkeypatch)
    assert _chi2(first, p0) < CHI2_BOUND
    assert abs(len(after_draft) / NUM_TRIALS - float(p0[DRAFT])) < 0.03  # acceptance rate = p(draft)
    assert _chi2(after_draft, p1) < CHI2_BOUND


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_emitted_tokens_follow_the_target_distribution_on_cuda(monkeypatch):
    """The same bound with the rows, the noise and the acceptance draws on the GPU."""
    sampler = Sampler()
    p0, p1 = _target_probs(sampler, 0, []), _target_probs(sampler, 1, [DRAFT])
    first, after_draft = _run(monkeypatch, "cuda")
    assert _chi2(first, p0) < CHI2_BOUND and _chi2(after_draft, p1) < CHI2_BOUND


def test_resampling_from_p_instead_of_the_residual_fails_the_bound(monkeypatch):
    monkeypatch.setattr(rs, "residual_distribution", lambda probs, drafts, has_draft: probs)
    first, _ = _run(monkeypatch)
    assert _chi2(first, _target_probs(Sampler(), 0, [])) > 10 * CHI2_BOUND


def test_accepting_every_draft_fails_the_bound(monkeypatch):
    monkeypatch.setattr(rs, "_uniform", lambda sampler, md, device: torch.zeros(md.num_rows))
    first, _ = _run(monkeypatch)
    assert _chi2(first, _target_probs(Sampler(), 0, [])) > 10 * CHI2_BOUND


def test_greedy_rows_keep_exactly_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 4.0, 0.0]])  # [4, 3]
    params = SamplingParams(temperature=0)
    md = build_sampling_metadata([params] * 4, [[0]] * 4, [[], [1], [], [0]], [], 3, "cpu")
    # rows 0-2: sequence A with drafts [1, 2] (1 is row 0's argmax, 2 is not row 1's); row 3: B, no draft
    targets, accepted = verify_rows(Sampler(), logits, md, torch.tensor([1, 2, -1, -1]))
    assert targets.tolist() == [1, 0, 2, 1] and accepted.tolist() == [True, False, False, False]
    assert accepted_tokens([[1, 2], []], targets.tolist(), accepted.tolist()) == [[1, 0], [1]]


def test_a_row_without_a_draft_draws_the_samplers_own_token():
    sampler, reference = Sampler(seed=5), Sampler(seed=5)
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))  # [8, 50]
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=100 + i) for i in range(8)]
    md = build_sampling_metadata(params, [[1]] * 8, [[2, 3]] * 8, [], 50, "cpu")
    targets, accepted = verify_rows(sampler, logits, md, torch.full((8,), -1))
    assert targets.tolist() == reference(logits, md)[0] and not accepted.any()


def test_row_chunks_give_the_same_tokens_as_one_pass(monkeypatch):
    """More rows than a sampler chunk (the grammar-free, seeded case: every draw is keyed by seed and
    output index, so chunking cannot change a token)."""
    logits = torch.randn(150, 40, generator=torch.Generator().manual_seed(1))  # [150, 40]
    params = [SamplingParams(temperature=0.9, top_k=20, seed=i, repetition_penalty=1.1) for i in range(150)]
    md = build_sampling_metadata(params, [[1, 2]] * 150, [[3] * (i % 4) for i in range(150)], [], 40, "cpu")
    drafts = torch.randint(0, 40, (150,), generator=torch.Generator().manual_seed(2))
    drafts[::5] = -1
    chunked = verify_rows(Sampler(), logits, md, drafts)
    monkeypatch.setattr(rs, "SAMPLER_CHUNK_ROWS", 10**9)
    whole = verify_rows(Sampler(), logits, md, drafts)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])
