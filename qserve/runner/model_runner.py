"""The model runner: turns a ``SchedulerOutput`` into one batched forward pass and a
``RunnerOutput``.

Knows: how to lay out a step's tokens (input ids, positions, slot mapping, block tables), the
paged KV tensors, and when to compute logits (sampling rows and prompt-logprob rows). Must not
know: scheduling policy, text, stop conditions or the HTTP layer. One forward per step over all
scheduled tokens; Python loops here run over sequences to build index lists, never over
weights or inside layers.
"""

from __future__ import annotations

import torch

from qserve.config import ModelConfig
from qserve.runner.attn_metadata import AttentionMetadata
from qserve.runner.sampler import Sampler, build_sampling_metadata, compute_prompt_logprobs
from qserve.scheduler.output import RunnerOutput, SchedulerOutput, TokenLogprobs


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (key, value) pair per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_layers)
    ]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.config = config
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(seed=seed)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        sequences = scheduler_output.sequences
        if not sequences:
            return RunnerOutput({}, {}, {})
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []  # token index whose logits are sampled, one per sampling sequence
        prompt_rows: list[int] = []  # token indices needing prompt logprobs
        prompt_targets: list[int] = []
        prompt_owners: list[tuple[str, int]] = []  # (request_id, k) per prompt-logprob row
        max_blocks = max(len(seq.block_ids) for seq in sequences)
        block_tables = torch.zeros(len(sequences), max_blocks, dtype=torch.int32)

        for i, seq in enumerate(sequences):
            start, count = seq.start_position, seq.num_new_tokens
            offset = len(input_ids)
            input_ids.extend(seq.input_token_ids())
            seq_positions = range(start, start + count)
            positions.extend(seq_positions)
            table = seq.block_ids
            slots.extend(table[p // block_size] * block_size + p % block_size for p in seq_positions)
            block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
            query_start_loc.append(offset + count)
            seq_lens.append(start + count)
            if seq.sample:
                sample_rows.append(offset + count - 1)
            k = seq.sampling_params.prompt_logprobs
            num_prompt = len(seq.prompt_token_ids)
            if k is not None and start < num_prompt - 1:
                for p in range(start, min(start + count, num_prompt - 1)):
                    prompt_rows.append(offset + p - start)
                    prompt_targets.append(seq.prompt_token_ids[p + 1])
                    prompt_owners.append((seq.request_id, k))

        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=block_tables.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int64, device=device),
            max_query_len=max(seq.num_new_tokens for seq in sequences),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.kv_caches,
            metadata,
        )  # [num_tokens, hidden]

        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        sampling_seqs = [seq for seq in sequences if seq.sample]
        if sampling_seqs:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=device)])  # [R, vocab]
            sampling_metadata = build_sampling_metadata(
                [seq.sampling_params for seq in sampling_seqs],
                [seq.prompt_token_ids for seq in sampling_seqs],
                [seq.output_token_ids for seq in sampling_seqs],
                list(self.config.eos_token_ids),
                logits.shape[-1],
                device,
            )
            tokens, token_logprobs = self.sampler(logits, sampling_metadata)
            for seq, token, token_lp in zip(sampling_seqs, tokens, token_logprobs):
                sampled[seq.request_id] = token
                if token_lp is not None:
                    logprobs[seq.request_id] = token_lp

        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        if prompt_rows:
            prompt_logits = self.model.compute_logits(hidden[torch.tensor(prompt_rows, device=device)])
            targets = torch.tensor(prompt_targets, dtype=torch.int64, device=device)
            max_k = max(k for _, k in prompt_owners)
            entries = compute_prompt_logprobs(prompt_logits, targets, max_k)
            for (request_id, k), entry in zip(prompt_owners, entries):
                if k < max_k:  # trim to what this request asked for: the actual token plus its top-k
                    entry = TokenLogprobs(entry.token_ids[: k + 1], entry.logprobs[: k + 1], entry.ranks[: k + 1])
                prompt_logprobs.setdefault(request_id, []).append(entry)
        return RunnerOutput(sampled, logprobs, prompt_logprobs)
