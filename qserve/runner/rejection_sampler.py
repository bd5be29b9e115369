"""Speculative decoding's verify step: which draft tokens the target model keeps, and the token
it adds, so that the output has exactly the distribution of sampling without speculation.

Knows: the rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for a proposer
whose draft distribution q is a point mass on the draft token d (n-gram lookup): keep d with
probability min(1, p(d) / q(d)) = p(d); on rejection draw from the residual max(0, p - q), i.e.
p with d removed and renormalized; after k kept drafts draw one more token from p. Greedy rows
keep d iff it is the argmax, and add the argmax: token for token what decoding without
speculation gives. p is the ``Sampler``'s own distribution of the row (penalties, logit_bias,
min_tokens, temperature, top-k, top-p, min-p), each row's penalties counting the drafts before
it as outputs. Must not know: the scheduler, requests, models.

Rows: a sequence with k drafts has k + 1 rows (row j scores the position after draft j - 1; row
0 the position after the last known token); ``draft_token_ids[row]`` is -1 on each sequence's
last row. Randomness: the draw from p or the residual is the sampler's exponential race with the
sampler's noise (seeded rows: a generator seeded by (seed, output index), so a row with no draft
gets the very token the sampler would give), the acceptance test a uniform draw (seeded rows: a
second stream keyed by (seed, output index)).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qserve.runner.sampler import (
    SAMPLER_CHUNK_ROWS,
    Sampler,
    SamplingMetadata,
    mask_padded_vocab,
    row_seed,
    slice_metadata,
)

# Keys the acceptance draws of seeded rows apart from their sampling noise.
ACCEPT_SEED_SALT = 0x5BD1E9955BD1E995


def verify_rows(
    sampler: Sampler, logits: torch.Tensor, metadata: SamplingMetadata, draft_token_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (the token to emit if the row's draft is rejected or it has none ``[N]`` int64,
    whether the row's draft is accepted ``[N]`` bool; False where it has none).

    logits: ``[N, V]`` the target's logits at every row; draft_token_ids: ``[N]`` int64 on the
    same device. Works in chunks of ``SAMPLER_CHUNK_ROWS`` rows (bounded temporaries).
    """
    num_rows = metadata.num_rows
    assert logits.dim() == 2 and logits.shape[0] == num_rows == draft_token_ids.shape[0]
    if num_rows <= SAMPLER_CHUNK_ROWS:
        return _verify_chunk(sampler, logits, metadata, draft_token_ids)
    tokens, accepted = [], []
    for start in range(0, num_rows, SAMPLER_CHUNK_ROWS):
        end = min(start + SAMPLER_CHUNK_ROWS, num_rows)
        t, a = _verify_chunk(
            sampler, logits[start:end], slice_metadata(metadata, start, end), draft_token_ids[start:end]
        )
        tokens.append(t)
        accepted.append(a)
    return torch.cat(tokens), torch.cat(accepted)


def _verify_chunk(
    sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata, drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    original = logits.float()  # [R, V]
    original = mask_padded_vocab(original, sampler.valid_vocab_size, in_place=original is not logits)
    processed = sampler.process_logits(original, md)  # [R, V]
    has_draft = drafts >= 0  # [R]
    safe_drafts = drafts.clamp(min=0).unsqueeze(1)  # [R, 1]
    greedy_tokens = processed.argmax(dim=-1)  # [R]
    if md.all_greedy:
        return greedy_tokens, has_draft & (greedy_tokens == drafts)
    probs = sampler.random_probs(processed, md)  # [R, V]
    draft_probs = probs.gather(1, safe_drafts).squeeze(1)  # [R] p(d)
    uniform = _uniform(sampler, md, probs.device)  # [R]
    random_accepted = has_draft & (uniform < draft_probs)
    residual = residual_distribution(probs, safe_drafts, has_draft)  # [R, V]
    noise = sampler._exponential_noise(residual, md)  # [R, V]
    random_tokens = residual.div_(noise).argmax(dim=-1)  # [R]
    if md.all_random:
        return random_tokens, random_accepted
    greedy = md.is_greedy
    return (
        torch.where(greedy, greedy_tokens, random_tokens),
        torch.where(greedy, has_draft & (greedy_tokens == drafts), random_accepted),
    )


def residual_distribution(probs: torch.Tensor, drafts: torch.Tensor, has_draft: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) for a point mass q on each row's draft: p with the draft's entry zeroed
    (unnormalized: the exponential race does not need it); p itself on rows without a draft.

    probs: ``[R, V]``; drafts: ``[R, 1]`` int64 (any valid id where ``has_draft`` ``[R]`` is False).
    """
    kept = probs.gather(1, drafts)  # [R, 1]
    residual = probs.scatter(1, drafts, torch.where(has_draft.unsqueeze(1), 0.0, kept))  # [R, V]
    # p(d) == 1 leaves nothing (and is always accepted): keep p there so the race stays defined.
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)


def _uniform(sampler: Sampler, md: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per row: seeded rows from (seed, output index), the others from the
    sampler's batch generator."""
    uniform = torch.empty(md.num_rows, dtype=torch.float32, device=device)  # [R]
    if any(s is None for s in md.seeds):
        uniform.uniform_(generator=sampler._batch_generator(device))
    seeded = [(r, s) for r, s in enumerate(md.seeds) if s is not None]
    if seeded:
        gen = torch.Generator(device=device)
        for row, seed in seeded:
            gen.manual_seed(row_seed(seed ^ ACCEPT_SEED_SALT, md.output_indices[row]))
            uniform[row : row + 1].uniform_(generator=gen)
    return uniform


def accepted_tokens(
    drafts: Sequence[Sequence[int]], targets: Sequence[int], accepted: Sequence[bool]
) -> list[list[int]]:
    """Per sequence (rows laid out as ``verify_rows`` takes them, sequence after sequence): its
    leading accepted drafts, then the target token of the first row whose draft was rejected (or
    of its last row when all were kept)."""
    result = []
    row = 0
    for draft in drafts:
        kept = 0
        while kept < len(draft) and accepted[row + kept]:
            kept += 1
        result.append([*draft[:kept], targets[row + kept]])
        row += len(draft) + 1
    assert row == len(targets), (row, len(targets))
    return result
