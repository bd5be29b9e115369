"""End-to-end GPU benchmark of the engine on a Qwen2.5-14B-shaped GPTQ-4bit checkpoint.

Builds the checkpoint with random weights on local disk, loads it through the real loader under
``--gpu-memory-budget``, and measures: cold start to first token, decode tok/s at batch
1/8/32/128 against the bandwidth floor, a ShareGPT-like offline workload, capacity (concurrent
1,024-token sequences running in one step) with model-dtype and fp8 KV, peak allocator memory vs
the budget, the plan vs what the runtime allocated, and (on a small model) GPU logits vs the CPU
reference path and CUDA graphs vs eager.

    python bench/e2e.py --out results.md            # on the H200 (about 5-8 minutes)
    python bench/e2e.py --small                     # a tiny shape, CPU or GPU, to check the script
    python bench/e2e.py --qwen14b-v1 --out v1.md    # only issue 15's capacity run (below), ~5 minutes
    python bench/e2e.py --model qwen3-30b-a3b --skip small,fp8 --out moe.md   # the MoE model (below)

``--qwen14b-v1``: capacity under the budget of a Qwen-14B (v1)-shaped GPTQ-4bit checkpoint (40 layers,
hidden 5120, 40 heads = 40 KV heads, MLP 13696, vocab 152064) with fp16 / fp8 / int8 / int4 KV:
the most 448-token sequences running in one step, decode tok/s at that load, the plan and the
peak allocator. The checkpoint is a *shape proxy*: Llama architecture (q/k/v biases as Qwen's
c_attn has), the same tensor shapes, so weights, KV bytes and kernel work are Qwen-14B v1's.

``--model qwen3-30b-a3b``: the same parts on a Qwen3-30B-A3B-shaped GPTQ-4bit g128 checkpoint (48 layers,
hidden 2048, 32 q / 4 KV heads of 128 with q/k norms, 128 experts top-8 of intermediate 768,
norm_topk_prob, vocab 151936; every linear quantized, routers 16-bit). Its decode floor counts the
bytes a step must read at batch B: attention, routers and norms of every layer, lm_head, and the
expected number of distinct experts a layer's B tokens hit, E·(1 − (1 − k/E)^B) (each token picks
k of E; uniform routing, as the random router gives); the rows report those bytes.

Numbers are printed as a table and written to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import memory_pools  # noqa: E402
from qserve import LLM, SamplingParams  # noqa: E402
from qserve.runner.cuda_allocator import prefer_expandable_segments  # noqa: E402
from tests.helpers.tokenizer import make_tokenizer  # noqa: E402

QWEN14B = dict(hidden=5120, layers=48, heads=40, kv_heads=8, inter=13824, vocab=152064)
SMALL = dict(hidden=256, layers=2, heads=4, kv_heads=2, inter=512, vocab=1024)
# Qwen-14B v1 (multi-head attention: 800 KiB of fp16 KV per token); written as a Llama-architecture
# shape proxy (a Qwen v1 loader is separate work), see write_random_gptq(architecture="llama").
QWEN14B_V1 = dict(hidden=5120, layers=40, heads=40, kv_heads=40, inter=13696, vocab=152064)
SMALL_V1 = dict(hidden=256, layers=2, heads=2, kv_heads=2, inter=512, vocab=1024)
V1_SEQ_LEN, V1_PROMPT_LEN = 448, 400  # issue 15: 128 sequences of ~448 tokens under 24 GiB
# Qwen3-30B-A3B (families.md (d)) and a toy of the same structure for --small (CPU).
QWEN3_30B_A3B = dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
                     moe_inter=768, vocab=151936)  # fmt: skip
SMALL_MOE = dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2, moe_inter=128, vocab=1024)
GIB = 2**30


def write_random_gptq(path: Path, shape: dict, group: int = 128, architecture: str = "qwen2") -> int:
    """A GPTQ v1 sym 4-bit checkpoint with random codes; returns its size in bytes.

    ``architecture``: "qwen2" (Qwen2ForCausalLM) or "llama" (LlamaForCausalLM with q/k/v biases,
    the shape proxy for Qwen v1)."""
    path.mkdir(parents=True, exist_ok=True)
    h, inter, vocab = shape["hidden"], shape["inter"], shape["vocab"]
    d = 128 if h >= 1024 else h // shape["heads"]
    q, kv = shape["heads"] * d, shape["kv_heads"] * d
    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
    dev = gen.device

    def linear(k: int, n: int) -> dict[str, torch.Tensor]:
        return random_gptq_linear(gen, k, n, group)

    total = 0
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}

    def flush(index: int) -> None:
        nonlocal shard, total
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(shard, name))
        shard = {}

    def dense(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=dev) * 0.02).half().cpu()

    shard["model.embed_tokens.weight"] = dense(vocab, h)
    shard["lm_head.weight"] = dense(vocab, h)
    shard["model.norm.weight"] = torch.ones(h, dtype=torch.float16)
    flush(0)
    for i in range(shape["layers"]):
        p = f"model.layers.{i}"
        for name, k, n in (
            ("self_attn.q_proj", h, q),
            ("self_attn.k_proj", h, kv),
            ("self_attn.v_proj", h, kv),
            ("self_attn.o_proj", q, h),
            ("mlp.gate_proj", h, inter),
            ("mlp.up_proj", h, inter),
            ("mlp.down_proj", inter, h),
        ):
            for suffix, tensor in linear(k, n).items():
                shard[f"{p}.{name}.{suffix}"] = tensor
        for name, n in (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)):
            shard[f"{p}.{name}.bias"] = torch.zeros(n, dtype=torch.float16)
        if architecture == "llama":  # Llama's attention_bias covers o_proj too (zero: Qwen v1's c_proj has none)
            shard[f"{p}.self_attn.o_proj.bias"] = torch.zeros(h, dtype=torch.float16)
        shard[f"{p}.input_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        shard[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        flush(i + 1)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    arch_fields = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 1000000.0}
    if architecture == "llama":
        arch_fields = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": True,
            "rope_theta": 10000.0,
        }
    config = {
        **arch_fields,
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "vocab_size": vocab,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "eos_token_id": 0,
        "quantization_config": {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    make_tokenizer(str(path))
    return total


def random_gptq_linear(gen: torch.Generator, k: int, n: int, group: int) -> dict[str, torch.Tensor]:
    """GPTQ v1 sym 4-bit tensors of one ``[K, N]`` linear: random codes, scales ~0.003, zeros 8."""
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=gen, device=gen.device, dtype=torch.int64)
    scales = torch.rand(k // group, n, generator=gen, device=gen.device) * 0.002 + 0.002
    return {
        "qweight": qweight.to(torch.int32).cpu(),  # [K/8, N]
        "qzeros": torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32),  # [K/g, N/8]
        "scales": scales.half().cpu(),  # [K/g, N]
    }


def _moe_linears(shape: dict) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """(attention linears, one expert's linears) of a sparse layer: (name, K, N)."""
    h, d, inter = shape["hidden"], shape["head_dim"], shape["moe_inter"]
    q, kv = shape["heads"] * d, shape["kv_heads"] * d
    attention = [("self_attn.q_proj", h, q), ("self_attn.k_proj", h, kv), ("self_attn.v_proj", h, kv),
                 ("self_attn.o_proj", q, h)]  # fmt: skip
    expert = [("gate_proj", h, inter), ("up_proj", h, inter), ("down_proj", inter, h)]
    return attention, expert


def write_random_moe_gptq(path: Path, shape: dict, group: int = 128, lm_head_bits: int = 16) -> int:
    """A Qwen3-MoE GPTQ v1 sym 4-bit checkpoint with random codes (every attention and expert
    linear quantized, per-expert tensors; routers, norms, embeddings and lm_head fp16), one
    shard per layer; returns its size in bytes. ``lm_head_bits=4``: the lm_head quantized too, as
    GPTQModel writes it with ``lm_head=True`` (``quantization_config.lm_head``; llama.cpp's Q4_K_M
    keeps it at 6 bits, Qwen's own GPTQ-Int4 release at 16)."""
    path.mkdir(parents=True, exist_ok=True)
    h, vocab, d = shape["hidden"], shape["vocab"], shape["head_dim"]
    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
    attention, expert = _moe_linears(shape)

    def dense(*size: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=gen.device) * std).half().cpu()

    total, weight_map = 0, {}

    def flush(shard: dict[str, torch.Tensor], index: int) -> int:
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        return sum(t.numel() * t.element_size() for t in shard.values())

    if lm_head_bits == 4:
        head = {f"lm_head.{suffix}": t for suffix, t in random_gptq_linear(gen, h, vocab, group).items()}
    else:
        head = {"lm_head.weight": dense(vocab, h)}
    total += flush(
        {"model.embed_tokens.weight": dense(vocab, h), **head, "model.norm.weight": torch.ones(h, dtype=torch.float16)},
        0,
    )
    for i in range(shape["layers"]):
        p = f"model.layers.{i}"
        shard: dict[str, torch.Tensor] = {}
        for name, k, n in attention:
            shard.update({f"{p}.{name}.{suffix}": t for suffix, t in random_gptq_linear(gen, k, n, group).items()})
        for e in range(shape["experts"]):
            for name, k, n in expert:
                tensors = random_gptq_linear(gen, k, n, group)
                shard.update({f"{p}.mlp.experts.{e}.{name}.{suffix}": t for suffix, t in tensors.items()})
        shard[f"{p}.mlp.gate.weight"] = dense(shape["experts"], h, std=0.05)  # the router [E, H], 16-bit
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shard[f"{p}.{norm}.weight"] = torch.ones(h, dtype=torch.float16)
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            shard[f"{p}.{norm}.weight"] = torch.ones(d, dtype=torch.float16)
        total += flush(shard, i + 1)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(qwen3_moe_config(shape, group, lm_head_bits)))
    make_tokenizer(str(path))
    return total


def qwen3_moe_config(shape: dict, group: int = 128, lm_head_bits: int = 16) -> dict:
    """The ``config.json`` of ``write_random_moe_gptq``'s checkpoint."""
    h, d = shape["hidden"], shape["head_dim"]
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": h,
        "intermediate_size": 3 * shape["moe_inter"],  # no dense layer uses it
        "moe_intermediate_size": shape["moe_inter"],
        "num_experts": shape["experts"],
        "num_experts_per_tok": shape["top_k"],
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": d,
        "vocab_size": shape["vocab"],
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "eos_token_id": 0,
        "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                "sym": True, "checkpoint_format": "gptq", "lm_head": lm_head_bits == 4},
    }  # fmt: skip


def expected_experts_hit(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a layer's ``batch`` tokens hit, in expectation (each token: k of E, uniform)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def moe_step_bytes(shape: dict, batch: int, group: int = 128, lm_head_bits: int = 16) -> dict[str, float]:
    """Bytes one decode step of ``batch`` sequences must read from the weights (KV ignored: short
    context), as qserve holds them: 4-bit codes + fp16 scales per linear (sym: no zeros), fp16
    routers, norms, lm_head (4-bit with ``lm_head_bits=4``). Keys: ``dense`` (everything but the experts), ``experts`` (the hit
    ones), ``hit`` (experts per layer), ``total``."""
    h, layers, d = shape["hidden"], shape["layers"], shape["head_dim"]
    attention, expert = _moe_linears(shape)

    def linear(k: int, n: int) -> int:
        return k * n // 2 + 2 * (k // group) * n

    per_layer = sum(linear(k, n) for _, k, n in attention) + 2 * shape["experts"] * h + 2 * (2 * h + 2 * d)
    head = linear(h, shape["vocab"]) if lm_head_bits == 4 else 2 * shape["vocab"] * h
    dense = layers * per_layer + head + 2 * h  # + lm_head, final norm
    hit = expected_experts_hit(shape["experts"], shape["top_k"], batch)
    experts = layers * hit * sum(linear(k, n) for _, k, n in expert)
    return {"dense": dense, "experts": experts, "hit": hit, "total": dense + experts}


def lognormal_lengths(count: int, mean: float, cap: int, gen: torch.Generator) -> list[int]:
    sigma = 1.0
    mu = math.log(mean) - sigma**2 / 2
    values = torch.exp(torch.randn(count, generator=gen) * sigma + mu)
    return [max(1, min(cap, int(v))) for v in values]


def start_decoding(llm: LLM, batch: int, prompt_len: int, max_tokens: int, vocab: int, seed: int, tag: str):  # noqa: ANN201
    """Add ``batch`` random prompts and step until every one has its first token (prefill done);
    returns the engine, ready for decode-only steps."""
    engine = llm.engine
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"{tag}{batch}-{i}", {"prompt_token_ids": ids}, params)
    while any(not seq.request.output_token_ids for _, seq in engine._sequences.values()):
        engine.step()
    return engine


def timed_decode(llm: LLM, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    """Decode tokens/s of ``batch`` sequences once their prompts are in."""
    engine = start_decoding(llm, batch, prompt_len, steps + 2, vocab, seed=batch, tag="dec")
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return batch * steps / elapsed


def profile_decode(llm: LLM, batch: int, vocab: int, folder: Path, steps: int = 8) -> tuple[str, str]:
    """Per-kernel CUDA time of ``steps`` decode steps (torch.profiler), and how much of the
    step's wall time the GPU was busy: the rest is host work the GPU waited for."""
    from torch.profiler import ProfilerActivity, profile

    engine = start_decoding(llm, batch, 128, steps + 4, vocab, seed=100 + batch, tag="prof")
    engine.step()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    kernels = sorted(
        (
            (e.key, e.self_device_time_total, e.count)
            for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ),
        key=lambda item: -item[1],
    )
    kernels = [k for k in kernels if k[1] > 0]
    busy = sum(k[1] for k in kernels)
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# decode batch {batch}: {steps} steps, wall {wall * 1e3 / steps:.2f} ms/step, "
        f"GPU kernels {busy / 1e3 / steps:.2f} ms/step",
        "",
        "| kernel | µs/step | calls/step |",
        "|---|---|---|",
    ]
    lines += [f"| {name[:90]} | {t / steps:.1f} | {c / steps:.1f} |" for name, t, c in kernels[:40]]
    (folder / f"profile_b{batch}.md").write_text("\n".join(lines) + "\n")
    return (
        f"profile decode batch {batch}",
        f"wall {wall * 1e3 / steps:.2f} ms/step, GPU kernel time {busy / 1e3 / steps:.2f} ms/step, "
        f"{sum(k[2] for k in kernels) / steps:.0f} kernels/step",
    )


class StepStats:
    """Where an offline run's time goes: wraps the scheduler to record every step's token count
    and kind, and the wall time from one schedule() to the next (the whole step)."""

    def __init__(self, llm: LLM) -> None:
        self.scheduler = llm.engine.scheduler
        self.inner = self.scheduler.schedule
        self.steps: list[tuple[int, int, bool, int]] = []  # (tokens, sequences, pure decode, preempted)
        self.times: list[float] = []
        self.last = None

        def schedule():  # noqa: ANN202 - same as the wrapped method
            now = time.perf_counter()
            if self.last is not None:
                self.times.append(now - self.last)
            self.last = now
            out = self.inner()
            decode = all(seq.num_new_tokens == 1 for seq in out.sequences)
            self.steps.append((out.num_batched_tokens, len(out.sequences), decode, len(out.preempted_request_ids)))
            return out

        self.scheduler.schedule = schedule

    def close(self) -> None:
        if self.last is not None:
            self.times.append(time.perf_counter() - self.last)
        self.scheduler.schedule = self.inner

    def describe(self) -> str:
        steps, times = self.steps, self.times
        decode = [(s, t) for s, t in zip(steps, times) if s[2] and s[0]]
        mixed = [(s, t) for s, t in zip(steps, times) if not s[2]]
        preempted = sum(s[3] for s in steps)

        def part(name: str, items: list) -> str:
            if not items:
                return f"{name}: none"
            total = sum(t for _, t in items)
            tokens = sum(s[0] for s, _ in items)
            seqs = sum(s[1] for s, _ in items) / len(items)
            return (
                f"{name}: {len(items)} steps, {total:.1f} s, {1e3 * total / len(items):.1f} ms/step, "
                f"{tokens / len(items):.0f} tokens and {seqs:.0f} sequences/step"
            )

        return f"{part('pure decode', decode)}; {part('with prefill', mixed)}; {preempted} preemptions"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    if not torch.cuda.is_available():
        return float("nan")
    src = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync()
    bw = 2 * src.numel() * 10 / (time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return bw


def small_model_checks(rows: list[tuple[str, str]], tmp: Path) -> None:
    """GPU logits vs the CPU reference path, and CUDA graphs vs eager, on a small model."""
    from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

    model = make_tiny_model("LlamaForCausalLM", seed=1, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    path = save_tiny_checkpoint(model, tmp / "small-llama", dtype=torch.float16)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 40, 130)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0)
    cpu = LLM(str(path), device="cpu", dtype="float32").generate(prompts, params)
    for name, kwargs in (("eager", {"enforce_eager": True}), ("graphs", {})):
        gpu = LLM(str(path), device="cuda", dtype="float16", **kwargs).generate(prompts, params)
        diffs = [
            abs(a.prompt_logprobs[i][t].logprob - b.prompt_logprobs[i][t].logprob)
            for a, b in zip(cpu, gpu)
            for i, t in enumerate(a.prompt_token_ids)
            if i > 0
        ]
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(cpu, gpu))
        rows.append(
            (f"small model GPU fp16 ({name}) vs CPU fp32", f"max |dlogprob| {max(diffs):.4f}; {same}/3 greedy equal")
        )


def kv_dtype_perplexity(rows: list[tuple[str, str]]) -> None:
    """Perplexity of the trained demo model on its held-out text with each KV cache dtype (GPU,
    fp16), next to the CPU float32 reference path. Attention reads every key and value back
    from the cache, prompt tokens included, so prompt log-probabilities see the cache's rounding."""
    from qserve.quantize.perplexity import perplexity, qserve_scorer

    repo = Path(__file__).resolve().parents[1]
    demo = str(repo / "recipes" / "demo" / "model")
    text = (repo / "recipes" / "demo" / "heldout.txt").read_text(encoding="utf-8")
    runs = [("cpu float32, model-dtype KV", "cpu", "float32", "auto")]
    runs += [(f"cuda float16, {kv} KV", "cuda", "float16", kv) for kv in ("auto", "fp8", "int8", "int4")]
    results = []
    for label, device, dtype, kv in runs:
        llm = LLM(demo, device=device, dtype=dtype, max_model_len=513, enable_prefix_caching=False, kv_cache_dtype=kv)
        ids = llm.get_tokenizer()(text)["input_ids"][:20000]  # bounded: the CPU run must stay short
        result = perplexity(ids, qserve_scorer(llm), max_length=512, stride=256)
        results.append(f"{label}: {result.perplexity:.4f}")
        del llm
    rows.append((f"demo model perplexity, held-out text ({result.num_scored} tokens)", "; ".join(results)))


def offline(llm: LLM, shape: dict, n: int, rows: list[tuple[str, str]], label: str) -> None:
    """The seeded ShareGPT-like workload, all requests at once; EOS ignored."""
    gen = torch.Generator().manual_seed(0)
    in_lens = lognormal_lengths(n, 256, 2048, gen)
    out_lens = lognormal_lengths(n, 256, 2048, gen)
    prompts = [{"prompt_token_ids": torch.randint(3, shape["vocab"], (k,), generator=gen).tolist()} for k in in_lens]
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in out_lens]
    stats = StepStats(llm)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    elapsed = time.perf_counter() - start
    stats.close()
    rows.append((f"offline step mix, {label}", stats.describe()))
    useful = sum(len(o.outputs[0].token_ids) for o in outs)
    rows.append(
        (
            f"offline ShareGPT-like, {label}",
            f"{n} requests, {sum(in_lens)} prompt / {useful} output tokens in {elapsed:.1f} s: "
            f"{useful / elapsed:.0f} output tok/s ({useful / elapsed / 75:.1f}x the HF transformers anchor of 75 tok/s)",
        )
    )


def qwen14b_v1_capacity(rows: list[tuple[str, str]], args: argparse.Namespace, device: str) -> None:
    """Issue 15 item 7: per KV dtype, one engine under the budget; the most 448-token sequences
    (400 prompt + 48 generated) running in one step, decode tok/s with that many sequences, the plan
    and the allocator's peak. Engines are built one at a time (each freed before the next)."""
    shape = SMALL_V1 if args.small else QWEN14B_V1
    tmp = Path(args.tmp)
    ckpt = tmp / ("qwen14b-v1-proxy-gptq" if not args.small else "small-v1-proxy-gptq")
    t0 = time.perf_counter()
    size = write_random_gptq(ckpt, shape, architecture="llama")
    rows.append(("Qwen-14B v1 proxy checkpoint", f"{size / GIB:.2f} GiB written in {time.perf_counter() - t0:.1f} s"))
    emit(rows, args.out)
    budget = args.budget if device == "cuda" else None
    num_requests = 200 if not args.small else 12
    for kv in args.v1_kv_dtypes.split(","):
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            llm = LLM(
                str(ckpt),
                device=device,
                gpu_memory_budget=budget,
                max_model_len=V1_SEQ_LEN,
                max_num_seqs=256,
                kv_cache_dtype=kv,
                enable_prefix_caching=False,
            )
        except Exception as err:  # noqa: BLE001 - report and go on with the other dtypes
            rows.append((f"v1 engine, KV {kv}", f"FAILED: {type(err).__name__}: {err}"))
            emit(rows, args.out)
            continue
        plan = llm.engine.memory_plan
        if plan is not None:
            rows.append((f"v1 plan, KV {kv}", plan.describe().replace("\n", "; ")))
        engine = llm.engine
        gen = torch.Generator().manual_seed(15)
        params = SamplingParams(temperature=0, max_tokens=V1_SEQ_LEN - V1_PROMPT_LEN, ignore_eos=True)
        for i in range(num_requests):
            ids = torch.randint(3, shape["vocab"], (V1_PROMPT_LEN,), generator=gen).tolist()
            engine.add_request(f"v1cap-{kv}-{i}", {"prompt_token_ids": ids}, params)
        most = 0
        sync()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            most = max(most, sum(r.num_computed_tokens >= V1_PROMPT_LEN for r in engine.scheduler.running))
        sync()
        elapsed = time.perf_counter() - start
        planned = plan.max_concurrent_sequences if plan else "n/a"
        rows.append(
            (
                f"v1 capacity, KV {kv}",
                f"{most} sequences of {V1_SEQ_LEN} tokens running at once (plan: {planned}); {num_requests} requests "
                f"done in {elapsed:.1f} s",
            )
        )
        emit(rows, args.out)
        # decode speed at the load the pool holds without preemption (admission may briefly overshoot it)
        load = min(most, plan.max_concurrent_sequences) if plan is not None else most
        if load:
            steps = 32 if not args.small else 4  # 400 + 34 tokens stay inside max_model_len
            tps = timed_decode(llm, load, V1_PROMPT_LEN, steps, shape["vocab"])
            rows.append((f"v1 decode at that load, KV {kv}", f"{tps:.0f} tok/s with {load} sequences"))
        if device == "cuda":
            peak = torch.cuda.max_memory_allocated()
            rows.append((f"v1 peak allocator, KV {kv}", f"{peak / GIB:.2f} GiB vs budget {budget}"))
        emit(rows, args.out)
        del llm, engine
    rows.append(("v1 note", "Llama-architecture shape proxy of Qwen-14B v1 (same tensor shapes, random GPTQ codes)"))
    emit(rows, args.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", default="e2e.md")
    parser.add_argument("--tmp", default="/tmp/qserve-bench")
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated parts to skip: small,decode,offline,capacity,fp8 (the fp8-KV engine)",
    )
    parser.add_argument(
        "--model", default="qwen2.5-14b", choices=("qwen2.5-14b", "qwen3-30b-a3b"), help="the random checkpoint's shape"
    )
    parser.add_argument(
        "--profile", default="", help="write per-kernel CUDA time tables of decode steps to this folder"
    )
    parser.add_argument(
        "--qwen14b-v1", action="store_true", help="run only the Qwen-14B v1 KV-dtype capacity measurement (issue 15)"
    )
    parser.add_argument("--v1-kv-dtypes", default="auto,fp8,int8,int4", help="KV dtypes of --qwen14b-v1")
    parser.add_argument("--decode-batches", default="1,8,32,128", help="batch sizes of the decode part")
    parser.add_argument(
        "--lm-head-bits",
        type=int,
        default=16,
        choices=(16, 4),
        help="--model qwen3-30b-a3b: the checkpoint's lm_head at 16 bits (Qwen's GPTQ-Int4 release) or GPTQ 4-bit "
        "(GPTQModel's lm_head=True); its own checkpoint folder",
    )
    parser.add_argument(
        "--reuse-checkpoint",
        action="store_true",
        help="keep the random checkpoint an earlier run wrote under --tmp (its cold start then reads a warm page cache)",
    )
    args = parser.parse_args()
    # The allocator setting qserve's engine asks for when it resolves its CUDA device: this script
    # starts CUDA before any engine (the random checkpoint, the copy bandwidth), so it asks first.
    prefer_expandable_segments()
    skip = set(filter(None, args.skip.split(",")))
    if args.qwen14b_v1:
        rows: list[tuple[str, str]] = []
        qwen14b_v1_capacity(rows, args, "cuda" if torch.cuda.is_available() else "cpu")
        return
    moe = args.model == "qwen3-30b-a3b"
    shape = (SMALL_MOE if moe else SMALL) if args.small else (QWEN3_30B_A3B if moe else QWEN14B)
    tmp = Path(args.tmp)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows: list[tuple[str, str]] = []

    if device == "cuda" and "small" not in skip:
        try:
            small_model_checks(rows, tmp)
        except Exception as err:  # noqa: BLE001 - report and go on with the other parts
            rows.append(("small model checks", f"FAILED: {type(err).__name__}: {err}"))
        emit(rows, args.out)
        try:
            kv_dtype_perplexity(rows)
        except Exception as err:  # noqa: BLE001
            rows.append(("KV dtype perplexity", f"FAILED: {type(err).__name__}: {err}"))
        emit(rows, args.out)

    t0 = time.perf_counter()
    head_bits = args.lm_head_bits
    if head_bits == 4 and not moe:
        parser.error("--lm-head-bits 4 is built for --model qwen3-30b-a3b only")
    name = f"{args.model}-gptq" + ("-q4head" if head_bits == 4 else "")
    ckpt = tmp / (name if not args.small else f"small-{name}")
    if args.reuse_checkpoint and (ckpt / "config.json").is_file():  # a same-shape run wrote it (cold start: warm cache)
        size = sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file())
        rows.append(("checkpoint", f"{size / GIB:.2f} GiB reused from {ckpt}"))
    else:
        size = write_random_moe_gptq(ckpt, shape, lm_head_bits=head_bits) if moe else write_random_gptq(ckpt, shape)
        rows.append(("checkpoint", f"{size / GIB:.2f} GiB written in {time.perf_counter() - t0:.1f} s"))
    bandwidth = copy_bandwidth()
    rows.append(("copy bandwidth", f"{bandwidth / 1e12:.2f} TB/s"))
    emit(rows, args.out)

    budget = args.budget if device == "cuda" else None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        llm = LLM(str(ckpt), device=device, gpu_memory_budget=budget, max_model_len=4096, max_num_seqs=256)
    except Exception as err:  # noqa: BLE001 - CUDA graphs are the riskiest part; measure eager then
        rows.append(("start-up with CUDA graphs", f"FAILED: {type(err).__name__}: {err}; falling back to eager"))
        gc.collect()
        torch.cuda.empty_cache() if device == "cuda" else None
        llm = LLM(
            str(ckpt), device=device, gpu_memory_budget=budget, max_model_len=4096, max_num_seqs=256, enforce_eager=True
        )
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1))
    cold = time.perf_counter() - start
    rows.append(("cold start to first token", f"{cold:.1f} s (target <= 30 s)"))
    plan = llm.engine.memory_plan
    if plan is not None:
        rows.append(("plan", plan.describe().replace("\n", "; ")))
        allocated = torch.cuda.memory_allocated()
        planned = plan.weights_bytes + plan.kv_cache_bytes + plan.overhead_bytes
        rows.append(
            (
                "plan vs runtime",
                f"planned weights+KV+overheads {planned / GIB:.3f} GiB, allocated {allocated / GIB:.3f} GiB "
                f"({100 * (allocated - planned) / planned:+.2f}%)",
            )
        )
        # What the card really gives the engine: the graphs' pools hold blocks no live tensor uses, which
        # memory_allocated leaves out; after empty_cache the allocator holds live tensors and those pools.
        torch.cuda.empty_cache()
        held = torch.cuda.memory_reserved()
        rows.append(
            (
                "plan vs held",
                f"planned {planned / GIB:.3f} GiB, held by the allocator after empty_cache (graph pools included) "
                f"{held / GIB:.3f} GiB ({100 * (held - planned) / planned:+.2f}%)",
            )
        )
        # pool by pool (issue 25): the plan's overheads against the graph pools they estimate
        snapshot = torch.cuda.memory_snapshot()
        rows.append(
            (
                "held by pool",
                memory_pools.describe(memory_pools.pools(snapshot))
                + f"; planned overheads {plan.overhead_bytes / GIB:.3f} GiB, activation peak "
                f"{plan.activation_bytes / GIB:.3f} GiB",
            )
        )
        rows.append(("default pool by stream", memory_pools.default_pool_parts(snapshot)))
    emit(rows, args.out)

    # Bytes read per decode step at batch 1: every weight once (the floor ignores KV at short context).
    weight_bytes = plan.weights_bytes - shape["vocab"] * shape["hidden"] * 2 if plan else 0  # embeddings not read
    if "decode" not in skip:
        for batch in (int(b) for b in args.decode_batches.split(",")):
            tps = timed_decode(llm, batch, 128, 32 if not args.small else 4, shape["vocab"])
            read = ""
            if moe:  # the experts a step reads grow with the batch
                step = moe_step_bytes(shape, batch, lm_head_bits=head_bits)
                weight_bytes = step["total"]
                read = (
                    f"; reads {step['total'] / 1e9:.3g} GB/step: {step['dense'] / 1e9:.3g} GB attention, routers "
                    f"and lm_head + {step['hit']:.1f} of {shape['experts']} experts/layer, {step['experts'] / 1e9:.3g} GB"
                )
            floor = bandwidth / weight_bytes * batch if weight_bytes else float("nan")
            rows.append(
                (
                    f"decode batch {batch}",
                    f"{tps:.1f} tok/s ({100 * tps / floor:.0f}% of the weight-read floor {floor:.0f}{read})",
                )
            )
            emit(rows, args.out)

    if args.profile and device == "cuda":
        for batch in (1, 64):
            rows.append(profile_decode(llm, batch, shape["vocab"], Path(args.profile)))
            emit(rows, args.out)

    if "capacity" not in skip:  # before the offline workload: a run cut short by its time limit keeps it
        rows.append(capacity(llm, "auto", shape, args.small))
        emit(rows, args.out)
    n_offline = args.num_requests if not args.small else min(args.num_requests, 40)
    if "offline" not in skip:
        offline(llm, shape, n_offline, rows, "model-dtype KV")
        emit(rows, args.out)
    if device == "cuda":
        rows.append(("peak allocator", f"{torch.cuda.max_memory_allocated() / GIB:.2f} GiB vs budget {budget}"))

    if "capacity" not in skip and "fp8" not in skip:
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        fp8 = LLM(str(ckpt), device=device, gpu_memory_budget=budget, max_model_len=4096, kv_cache_dtype="fp8")
        rows.append(capacity(fp8, "fp8", shape, args.small))
        if fp8.engine.memory_plan is not None:
            rows.append(("plan, fp8 KV", fp8.engine.memory_plan.describe().replace("\n", "; ")))
        emit(rows, args.out)
        if "offline" not in skip:
            offline(fp8, shape, n_offline, rows, "fp8 KV")
        if device == "cuda":
            rows.append(("peak allocator (fp8 engine)", f"{torch.cuda.max_memory_allocated() / GIB:.2f} GiB"))
    emit(rows, args.out)


def capacity(llm: LLM, kv: str, shape: dict, small: bool) -> tuple[str, str]:
    """The most 1,024-token sequences (880 prompt + 144 generated) running in one step, counting
    those whose prompt is in (>= 880 tokens computed); outputs long enough that the pool, not
    the workload, is the limit."""
    engine = llm.engine
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_tokens=144, ignore_eos=True)
    for i in range(200 if not small else 8):
        ids = torch.randint(3, shape["vocab"], (880,), generator=gen).tolist()
        engine.add_request(f"cap-{kv}-{i}", {"prompt_token_ids": ids}, params)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, sum(r.num_computed_tokens >= 880 for r in engine.scheduler.running))
    plan = engine.memory_plan
    planned = plan.concurrent_sequences_at[1024] if plan else "n/a"
    return (f"capacity, KV {kv}", f"{most} sequences of 1,024 tokens running at once (plan: {planned})")


def emit(rows: list[tuple[str, str]], out: str) -> None:
    """Print the newest row and rewrite the whole table (a run cut short keeps what it measured)."""
    print(rows[-1], flush=True)
    table = "| measure | result |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
    Path(out).write_text(table + "\n")


if __name__ == "__main__":
    main()
