"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, sampling_params)`` and
``LLM(model).chat(messages, sampling_params)``; ``LLM(model).embed(prompts)`` for embeddings.

Knows: how to feed a batch of prompts through an ``Engine`` and return outputs in input order,
how chat conversations become prompts through the tokenizer's chat template, and the optional
progress bar (``use_tqdm``, as vLLM), and LoRA adapters per prompt (``lora_request``: one for every
prompt or one per prompt, vLLM's argument). Must not know: anything the engine does not expose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qserve.engine.engine import Engine, EngineConfig, PromptInput
from qserve.lora.request import LoRARequest
from qserve.model.hub import resolve_model_path
from qserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from qserve.pooling_params import PoolingParams
from qserve.sampling_params import SamplingParams
from qserve.scheduler.swap import check_tensor_parallel_preemption
from qserve.spec_decode.config import SpeculativeConfig, check_tensor_parallel_speculation


class LLM:
    def __init__(
        self,
        model: str,
        device: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        tokenizer: str | None = None,
        gpu_memory_budget: str | None = None,
        kv_cache_dtype: str = "auto",
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        skip_tokenizer_init: bool = False,
        async_scheduling: bool = True,
        preemption_mode: str = "recompute",
        swap_space: float = 4.0,
        revision: str | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        enable_expert_parallel: bool = False,
    ) -> None:
        config = EngineConfig(
            model=resolve_model_path(str(model), revision),  # a Hub id (org/name): its cached snapshot
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            tokenizer=tokenizer,
            gpu_memory_budget=gpu_memory_budget,
            kv_cache_dtype=kv_cache_dtype,
            enforce_eager=enforce_eager,
            skip_tokenizer_init=skip_tokenizer_init,
            async_scheduling=async_scheduling,
            preemption_mode=preemption_mode,
            swap_space=swap_space,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            speculative_config=speculative_config,
            enable_expert_parallel=enable_expert_parallel,
        )
        # tensor_parallel_size > 1: this process is rank 0 and drives; the other ranks are
        # spawned processes (qserve.engine.tensor_parallel), stopped by shutdown() or at exit.
        self._tensor_parallel = None
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        check_tensor_parallel_preemption(preemption_mode, tensor_parallel_size)  # before any worker starts
        check_tensor_parallel_speculation(config.speculative_config, tensor_parallel_size)
        if tensor_parallel_size > 1:
            from qserve.engine.tensor_parallel import launch_engine

            self._tensor_parallel = launch_engine(config, tensor_parallel_size)
            self.engine = self._tensor_parallel.engine
        else:
            self.engine = Engine(config)
        self._counter = 0

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (no-op for a single-process LLM)."""
        if self._tensor_parallel is not None:
            self._tensor_parallel.shutdown()

    def get_tokenizer(self):  # noqa: ANN201 - a transformers tokenizer (None with skip_tokenizer_init)
        return self.engine.tokenizer

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or several (a
        list of such lists); the chat template renders each into a prompt, then as ``generate``."""
        if not messages:
            raise ValueError("messages is empty: give a conversation (a list of messages) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template= or use generate()")
        prompts: list[PromptInput] = []
        for i, conversation in enumerate(conversations):
            if not conversation or not all(isinstance(m, dict) and "role" in m for m in conversation):
                raise ValueError(f"conversation {i} must be a non-empty list of {{'role', 'content'}} messages")
            text = tokenizer.apply_chat_template(
                list(conversation),
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
            # The template already has the special tokens it wants: do not add BOS again.
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (vLLM's ``LLM.embed``): the last prompt
        token's final hidden state, L2-normalized unless ``pooling_params.normalize`` is False."""
        params = pooling_params if pooling_params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        outputs = self._run(prompts, params, use_tqdm, lora_request)
        return [
            EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.embedding or []), o.prompt_token_ids, o.finished)
            for o in outputs
        ]

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        All requests are validated before any is queued, so a bad one raises ValueError and
        leaves the engine as it was. ``use_tqdm`` shows a progress bar of finished requests
        (as vLLM; it writes to stderr). ``lora_request``: the adapter of every prompt, or one per
        prompt (None: the base model); needs ``enable_lora=True``.
        """
        return self._run(prompts, sampling_params, use_tqdm, lora_request)

    def _run(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | PoolingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (SamplingParams, PoolingParams)):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; pass one or one per prompt"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(
                    f"got {len(loras)} lora_request for {len(prompts)} prompts; pass one or one per prompt"
                )
        for prompt, params, lora in zip(prompts, params_list, loras):
            self.engine.validate_request(prompt, params, lora)
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):  # adapters read (and checked) now
            self.engine.add_lora(lora)
        request_ids = []
        for prompt, params, lora in zip(prompts, params_list, loras):
            request_id = f"llm-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, prompt, params, lora_request=lora)
            request_ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while wanted - finished.keys():
                # Only finished outputs are needed here: the engine skips building the others.
                for output in self.engine.step(finished_only=True):
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in request_ids]
