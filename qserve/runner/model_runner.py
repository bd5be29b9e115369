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
from qserve.runner.cuda_graphs import DecodeGraphs
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
        self.decode_graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture CUDA graphs for pure-decode steps (after kernels are warm; before serving)."""
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_caches, max_num_seqs, max_model_len, self.block_size, self.device
        )
        self.decode_graphs.capture()

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
        for seq in sequences:
            start, count = seq.start_position, seq.num_new_tokens
            offset = len(input_ids)
            input_ids.extend(seq.input_token_ids())
            seq_positions = range(start, start + count)
            positions.extend(seq_positions)
            table = seq.block_ids
            slots.extend(table[p // block_size] * block_size + p % block_size for p in seq_positions)
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

        graphs = self.decode_graphs
        is_pure_decode = len(input_ids) == len(sequences) and len(sample_rows) == len(sequences) and not prompt_rows
        if graphs is not None and is_pure_decode and graphs.bucket_for(len(sequences)) is not None:
            sample_logits = graphs.replay(input_ids, positions, slots, [seq.block_ids for seq in sequences])
            prompt_logits = None
        else:
            sample_logits, prompt_logits = self._forward_eager(
                sequences, input_ids, positions, slots, query_start_loc, seq_lens, sample_rows, prompt_rows
            )
        return self._sample(sequences, sample_logits, prompt_logits, prompt_targets, prompt_owners)

    def _forward_eager(
        self,
        sequences: list,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        query_start_loc: list[int],
        seq_lens: list[int],
        sample_rows: list[int],
        prompt_rows: list[int],
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        device = self.device
        max_blocks = max(len(seq.block_ids) for seq in sequences)
        tables = [seq.block_ids + [0] * (max_blocks - len(seq.block_ids)) for seq in sequences]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),  # [num_seqs, max_blocks]
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
        sample_logits = prompt_logits = None
        if sample_rows:
            sample_logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=device)])  # [R, vocab]
        if prompt_rows:
            prompt_logits = self.model.compute_logits(hidden[torch.tensor(prompt_rows, device=device)])  # [P, vocab]
        return sample_logits, prompt_logits

    def _sample(
        self,
        sequences: list,
        sample_logits: torch.Tensor | None,
        prompt_logits: torch.Tensor | None,
        prompt_targets: list[int],
        prompt_owners: list[tuple[str, int]],
    ) -> RunnerOutput:
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        sampling_seqs = [seq for seq in sequences if seq.sample]
        if sample_logits is not None:
            sampling_metadata = build_sampling_metadata(
                [seq.sampling_params for seq in sampling_seqs],
                [seq.prompt_token_ids for seq in sampling_seqs],
                [seq.output_token_ids for seq in sampling_seqs],
                list(self.config.eos_token_ids),
                sample_logits.shape[-1],
                self.device,
            )
            tokens, token_logprobs = self.sampler(sample_logits, sampling_metadata)
            for seq, token, token_lp in zip(sampling_seqs, tokens, token_logprobs):
                sampled[seq.request_id] = token
                if token_lp is not None:
                    logprobs[seq.request_id] = token_lp

        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        if prompt_logits is not None:
            targets = torch.tensor(prompt_targets, dtype=torch.int64, device=self.device)
            max_k = max(k for _, k in prompt_owners)
            entries = compute_prompt_logprobs(prompt_logits, targets, max_k)
            for (request_id, k), entry in zip(prompt_owners, entries):
                if k < max_k:  # trim to what this request asked for: the actual token plus its top-k
                    entry = TokenLogprobs(entry.token_ids[: k + 1], entry.logprobs[: k + 1], entry.ranks[: k + 1])
                prompt_logprobs.setdefault(request_id, []).append(entry)
        return RunnerOutput(sampled, logprobs, prompt_logprobs)
