"""Generate the quantize-then-serve recipe files (one JSON per model x method x card).

Knows: the reference models' shapes, the cards' memory, and the plan arithmetic: weights at
4-bit g128 as qserve holds them (packed codes 0.5 B/weight, fp16 scales per group, uint8 zero
points per group for AWQ's asymmetric weights; embeddings, lm_head, norms and biases fp16), fp16
KV bytes per token, KV tokens = (budget − weights − overhead) / KV bytes per token, and
concurrent 4k-token sequences. Must not know: qserve internals (standard library only).

Run from anywhere: ``python recipes/make_recipes.py`` rewrites ``recipes/<model>/<method>-<card>.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1024**3
OVERHEAD_BYTES = int(1.5 * GIB)  # activations of the largest step, CUDA graphs, allocator slack
BLOCK_SIZE = 16  # KV page size in tokens
CONTEXT = 4096
BITS, GROUP = 4, 128

MODELS = {
    "qwen2.5-7b-instruct": dict(hf="Qwen/Qwen2.5-7B-Instruct", layers=28, hidden=3584, heads=28, kv_heads=4,
                                head_dim=128, inter=18944, vocab=152064, tied=False, qkv_bias=True),
    "qwen2.5-14b-instruct": dict(hf="Qwen/Qwen2.5-14B-Instruct", layers=48, hidden=5120, heads=40, kv_heads=8,
                                 head_dim=128, inter=13824, vocab=152064, tied=False, qkv_bias=True),
    "llama-3.1-8b-instruct": dict(hf="meta-llama/Llama-3.1-8B-Instruct", layers=32, hidden=4096, heads=32, kv_heads=8,
                                  head_dim=128, inter=14336, vocab=128256, tied=False, qkv_bias=False),
    "mistral-7b-instruct-v0.3": dict(hf="mistralai/Mistral-7B-Instruct-v0.3", layers=32, hidden=4096, heads=32,
                                     kv_heads=8, head_dim=128, inter=14336, vocab=32768, tied=False, qkv_bias=False),
    # Mixture of experts: every layer sparse (128 experts of 768, top-8), router [128, 2048] and q/k norms fp16.
    "qwen3-30b-a3b": dict(hf="Qwen/Qwen3-30B-A3B", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                          inter=6144, vocab=151936, tied=False, qkv_bias=False, experts=128, moe_inter=768,
                          qk_norm=True),
}  # fmt: skip
CARDS = {
    "rtx3090": dict(name="NVIDIA GeForce RTX 3090", memory_gib=24, budget="22GiB"),
    "rtx4090": dict(name="NVIDIA GeForce RTX 4090", memory_gib=24, budget="22GiB"),
    "a10g": dict(name="NVIDIA A10G", memory_gib=24, budget="21GiB"),  # 22.5 GiB usable of its 24 GB
}
METHODS = ("gptq", "awq")
MOE_METHODS = ("gptq",)  # qserve quantize has no AWQ for mixture-of-experts models


def methods_of(model_key: str) -> tuple[str, ...]:
    return MOE_METHODS if MODELS[model_key].get("experts") else METHODS


def linear_shapes(m: dict) -> list[tuple[int, int]]:
    """(K, N) of every quantized Linear."""
    h, q, kv, i = m["hidden"], m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"], m["inter"]
    if m.get("experts"):  # every expert resident
        mi = m["moe_inter"]
        return ([(h, q), (h, kv), (h, kv), (q, h)] + [(h, mi), (h, mi), (mi, h)] * m["experts"]) * m["layers"]
    per_layer = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    return per_layer * m["layers"]


def weight_bytes(m: dict, method: str) -> dict[str, int]:
    quantized = 0
    for k, n in linear_shapes(m):
        groups = -(-k // GROUP)
        quantized += k * n * BITS // 8 + groups * n * 2  # codes + fp16 scales
        if method == "awq":
            quantized += groups * n  # uint8 zero points (asymmetric)
    embed = m["vocab"] * m["hidden"] * 2
    lm_head = 0 if m["tied"] else embed
    norms = (2 * m["layers"] + 1) * m["hidden"] * 2
    biases = m["layers"] * (m["heads"] + 2 * m["kv_heads"]) * m["head_dim"] * 2 if m["qkv_bias"] else 0
    norms += m["layers"] * 2 * m["head_dim"] * 2 if m.get("qk_norm") else 0
    norms += m["layers"] * m.get("experts", 0) * m["hidden"] * 2  # routers
    total = quantized + embed + lm_head + norms + biases
    return {"quantized_linears": quantized, "embeddings_and_lm_head_fp16": embed + lm_head,
            "norms_and_biases_fp16": norms + biases, "total": total}  # fmt: skip


def parse_gib(text: str) -> int:
    assert text.endswith("GiB")
    return int(float(text[:-3]) * GIB)


def recipe(model_key: str, method: str, card_key: str) -> dict:
    m, card = MODELS[model_key], CARDS[card_key]
    budget = parse_gib(card["budget"])
    weights = weight_bytes(m, method)
    kv_per_token = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * 2  # K and V, fp16
    kv_bytes = budget - weights["total"] - OVERHEAD_BYTES
    kv_tokens = max(0, kv_bytes // kv_per_token) // BLOCK_SIZE * BLOCK_SIZE
    name = f"{model_key}-{method}-{card_key}"
    calib_args = "--calib {calib} --num-samples 128 --seq-len 512"
    method_args = (
        "--method gptq --bits 4 --group-size 128 --sym"
        if method == "gptq"
        else "--method awq --bits 4 --group-size 128"
    )
    return {
        "name": name,
        "model": m["hf"],
        "method": method,
        "card": card["name"],
        "card_memory_gib": card["memory_gib"],
        "quantize": f"qserve quantize {{model_path}} {{output_path}} {method_args} {calib_args}",
        "serve": f"qserve serve {{output_path}} --gpu-memory-budget {card['budget']} --max-model-len {CONTEXT}",
        "output_path": f"{{model_path}}-{method}-int4",
        "plan": {
            "gpu_memory_budget": card["budget"],
            "weights_bytes": weights["total"],
            "weights_gib": round(weights["total"] / GIB, 2),
            "weights_breakdown_bytes": weights,
            "overhead_bytes": OVERHEAD_BYTES,
            "kv_bytes_per_token": kv_per_token,
            "kv_bytes": kv_tokens * kv_per_token,
            "kv_gib": round(kv_tokens * kv_per_token / GIB, 2),
            "kv_tokens": kv_tokens,
            "context_len": CONTEXT,
            "max_concurrent_seqs_at_context": kv_tokens // CONTEXT,
        },
        "notes": "Plan numbers are computed from the model's shapes by recipes/make_recipes.py; `qserve plan` "
        "prints the engine's own (measured activations replace the overhead estimate on the GPU).",
    }


def main() -> int:
    for model_key in MODELS:
        (HERE / model_key).mkdir(exist_ok=True)
        for method in methods_of(model_key):
            for card_key in CARDS:
                data = recipe(model_key, method, card_key)
                path = HERE / model_key / f"{method}-{card_key}.json"
                path.write_text(json.dumps(data, indent=2) + "\n")
                plan = data["plan"]
                print(f"{data['name']:45s} weights {plan['weights_gib']:5.2f} GiB  KV {plan['kv_tokens']:7d} tokens  "
                      f"{plan['max_concurrent_seqs_at_context']:3d} x 4k")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
