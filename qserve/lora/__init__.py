"""Multi-LoRA: PEFT adapters served on top of the (4-bit or dense) base model, several in one batch.

``request``: ``LoRARequest`` (vLLM's name) and ``LoRAConfig`` (pure Python). ``peft``: reading and
checking a PEFT adapter directory against the base model. ``slots``: the GPU-resident adapter slots
of every LoRA layer, the host-memory cache and the per-step row-to-slot indices (``LoRAManager``).
The math is ``quant_kernels.lora_ops``.
"""
