"""``LoRARequest`` (vLLM's name and fields) and ``LoRAConfig`` (the ``--max-loras`` family of limits).

Knows: what names an adapter and the limits an engine serves adapters under. Must not know: torch,
files, the model. Pure Python (the CLI and the scheduler import it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """One adapter, as vLLM names it: ``LoRARequest(lora_name, lora_int_id, lora_path)``.

    ``lora_name`` is how requests address it (the ``model`` of an HTTP request); ``lora_path`` is a
    PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``). qserve keys
    adapters by name; ``lora_int_id`` is kept for vLLM compatibility (it must be positive, as there).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request.lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path: adapter {self.lora_name!r} needs the path of its directory")

    # vLLM's accessors
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """``max_loras``: adapters resident on the device at once (slots; also the most distinct adapters
    in one step); ``max_lora_rank``: the largest rank accepted (slots are sized for it);
    ``max_cpu_loras``: adapters kept loaded in host memory (default: ``max_loras``)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"max_loras must be an integer >= 1, got {self.max_loras!r}")
        if isinstance(self.max_lora_rank, bool) or not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be an integer >= 1, got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): every adapter on "
                "the device also has its host copy"
            )

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
