"""``quantize_checkpoint``: fp16/bf16 HF checkpoint in, standard GPTQ / AWQ checkpoint out.

Knows: the layer-by-layer flow shared by every method — read one decoder layer's tensors from
the (sharded) safetensors source, put only that layer on the device, quantize it (GPTQ, AWQ or
RTN), write its tensors, push the calibration activations through the quantized layer to become
the next layer's inputs — plus the progress bar, timing and the choice of output layout (GPTQ v1
for gptq/rtn, AWQ GEMM for awq). Mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE, Mixtral) take
the sparse calibration layer and GPTQ (``moe``) or AWQ (``awq_moe``) per expert, and the experts
that took the starved-expert fallback are logged and returned in the report. Must not know: the
algorithms' insides (``gptq``, ``awq``, ``rtn``, ``moe``, ``awq_moe``), the bit layouts
(``writers``) or the serving engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

import loaders
from loaders.safetensors_io import CheckpointFiles
from qserve.config import ModelConfig
from qserve.layers.rotary import RotaryEmbedding
from qserve.model.registry import read_model_config
from qserve.quantize import writers
from qserve.quantize.awq import AWQSettings, quantize_layer_awq
from qserve.quantize.awq_moe import quantize_layer_awq_moe
from qserve.quantize.calibration import calibration_windows
from qserve.quantize.gptq import GPTQSettings, quantize_layer_gptq
from qserve.quantize.layer import DenseDecoderLayer
from qserve.quantize.moe import MoEQuantReport, SparseDecoderLayer, quantize_layer_gptq_moe
from qserve.quantize.quantizer import QuantizedLinear, check_settings
from qserve.quantize.rtn import RTNSettings, quantize_layer_rtn

logger = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "rtn")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")  # quantized per expert
_ACTIVATION_BYTES = 512 * 1024**2  # transient activations per calibration batch


@dataclass(frozen=True, slots=True)
class QuantizeOptions:
    method: str = "gptq"  # gptq | awq | rtn
    bits: int = 4
    group_size: int = 128  # -1 = per-channel
    sym: bool | None = None  # None: symmetric for gptq/rtn; awq is always asymmetric
    desc_act: bool = False
    damp_percent: float = 0.01
    block_size: int = 128
    calib: str | None = None
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    device: str | None = None  # None: cuda if available, else cpu
    awq_grid: int = 20
    max_shard_bytes: int = writers.DEFAULT_SHARD_BYTES
    progress: bool = True


@dataclass(frozen=True, slots=True)
class QuantizeReport:
    path: Path
    method: str
    seconds: float
    num_layers: int
    bytes_written: int
    # mixture of experts: HF names of the expert linears that took the starved-expert fallback
    fallback: tuple[str, ...] = ()


def validate(options: QuantizeOptions) -> None:
    if options.method not in METHODS:
        raise ValueError(f"--method {options.method!r} is not supported; supported: {', '.join(METHODS)}")
    check_settings(options.method, options.bits, options.group_size)
    if options.method == "awq" and options.sym:
        raise ValueError("--sym is not available for awq: AWQ GEMM checkpoints are asymmetric (zero_point=true)")
    if options.method == "awq" and options.desc_act:
        raise ValueError("--desc-act is not available for awq: AWQ has no act-order")
    if options.method != "rtn" and not options.calib:
        raise ValueError(
            f"--method {options.method} needs calibration text: pass --calib FILE (.txt, .jsonl or a saved datasets directory)"
        )
    if not 0 <= options.damp_percent < 1:
        raise ValueError(f"--damp-percent {options.damp_percent} must be in [0, 1)")


def resolve_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _check_source(src: Path) -> ModelConfig:
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: no config.json (is this a Hugging Face model directory?)")
    spec = loaders.detect(src)
    if spec.method != "none":
        raise ValueError(
            f"{src} is already quantized ({spec.source} says quant_method={spec.method}); give an fp16/bf16 checkpoint"
        )
    config = read_model_config(src)
    if config.family in MOE_FAMILIES:  # Llama attention names plus the experts': written as they are read
        return config
    if config.family != "llama":  # the writers emit Llama tensor names; other families' layouts differ
        raise ValueError(
            f"{src}: qserve quantize supports Llama-family and MoE (Qwen3-MoE, Qwen2-MoE, Mixtral) checkpoints "
            f"only; {config.architecture} "
            f"(family {config.family}) is served from its own GPTQ releases"
        )
    return config


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    options: QuantizeOptions,
    observer: Callable[[str, QuantizedLinear], None] | None = None,
) -> QuantizeReport:
    """Quantize ``src`` into ``dst`` (created; must be absent or empty). See the module docstring.

    ``observer(hf_module_name, quantized)`` is called for every quantized Linear (tests use it to
    compare what was written with what the quantizer meant).
    """
    validate(options)
    src, dst = Path(src), Path(dst)
    config = _check_source(src)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"output directory {dst} is not empty; choose a new path")
    method = options.method
    sym = True if options.sym is None and method != "awq" else bool(options.sym)
    device = resolve_device(options.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    start = time.perf_counter()

    hidden = None  # [S, T, hidden] calibration activations entering the current layer
    files = CheckpointFiles(src)
    try:
        if method != "rtn":
            from qserve.tokenization import auto_tokenizer  # noqa: PLC0415 - only calibrated methods need it

            tokenizer = auto_tokenizer(str(src))
            tokens = calibration_windows(options.calib, tokenizer, options.num_samples, options.seq_len, options.seed)
            embed = files.get("model.embed_tokens.weight").to(device=device, dtype=torch.float32)  # [vocab, hidden]
            hidden = embed[tokens.to(device)]  # [S, T, hidden]
            del embed
        seq_len = hidden.shape[1] if hidden is not None else 1
        rotary = RotaryEmbedding(config.rope, config.head_dim, max(seq_len, 1)).to(device)
        widest = max(config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim)
        batch_size = max(1, _ACTIVATION_BYTES // (seq_len * widest * 4 * 4))

        out = writers.ShardedSafetensorsWriter(dst, options.max_shard_bytes)
        names = files.names()
        layer_names = [n for n in names if n.startswith("model.layers.")]
        other_names = [n for n in names if not n.startswith("model.layers.")]
        head = [n for n in other_names if n.startswith("model.embed_tokens.")]
        for name in head:
            out.add(name, _fp16(files.get(name)))

        moe_report = MoEQuantReport()
        bar = tqdm(
            range(config.num_layers), desc=f"{method} {options.bits}-bit", unit="layer", disable=not options.progress
        )
        for i in bar:
            prefix = f"model.layers.{i}."
            tensors = {
                n[len(prefix) :]: files.get(n)
                for n in layer_names
                if n.startswith(prefix) and not n.endswith("rotary_emb.inv_freq")
            }
            sparse = config.is_moe_layer(i)
            starved_before = len(moe_report.rtn_fallback)
            layer = (SparseDecoderLayer if sparse else DenseDecoderLayer)(config, tensors, rotary, device)
            del tensors
            if method == "gptq" and sparse:
                settings = GPTQSettings(
                    options.bits, options.group_size, sym, options.desc_act, options.damp_percent, options.block_size
                )
                results = quantize_layer_gptq_moe(layer, hidden, settings, batch_size, moe_report)
            elif method == "gptq":
                settings = GPTQSettings(
                    options.bits, options.group_size, sym, options.desc_act, options.damp_percent, options.block_size
                )
                results = quantize_layer_gptq(layer, hidden, settings, batch_size)
            elif method == "awq":
                awq_settings = AWQSettings(options.bits, options.group_size, options.awq_grid)
                if sparse:
                    results, alphas = quantize_layer_awq_moe(layer, hidden, awq_settings, batch_size, moe_report)
                else:
                    results, alphas = quantize_layer_awq(layer, hidden, awq_settings, batch_size)
                bar.set_postfix({k: f"{v:.2f}" for k, v in alphas.items()})
                logger.info("layer %d AWQ alphas %s", i, alphas)
            else:
                results = quantize_layer_rtn(layer, RTNSettings(options.bits, options.group_size, sym))
            moe_report.rtn_fallback[starved_before:] = [prefix + n for n in moe_report.rtn_fallback[starved_before:]]
            if hidden is not None and i + 1 < config.num_layers:
                hidden = layer.run(hidden, batch_size)
            pack = writers.awq_tensors if method == "awq" else writers.gptq_tensors
            for short, hf in layer.linear_names.items():
                out.add_all(pack(f"{prefix}{hf}", results[short]))
                if observer is not None:
                    observer(f"{prefix}{hf}", results[short])
            for name, tensor in layer.fp_tensors().items():
                out.add(prefix + name, _fp16(tensor))
            del layer, results
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for name in other_names:
            if name not in head:
                out.add(name, _fp16(files.get(name)))
        out.finish()
    finally:
        files.close()

    if method == "awq":
        qconfig = writers.awq_quantization_config(options.bits, options.group_size, _awq_not_converted(config))
    else:
        qconfig = writers.gptq_quantization_config(
            options.bits,
            options.group_size,
            options.desc_act if method == "gptq" else False,
            sym,
            options.damp_percent,
            method,
        )
    writers.write_configs(src, dst, qconfig)
    if moe_report.rtn_fallback:
        starved = moe_report.rtn_fallback
        logger.warning(
            "%d of %d experts saw too few calibration tokens; %s: %s",
            len({n.rsplit(".", 1)[0] for n in starved}),
            moe_report.experts,
            "their down_proj got no AWQ scale (plain min-max)" if method == "awq" else "quantized round-to-nearest",
            ", ".join(starved[:8]) + (f" ... ({len(starved)} linears)" if len(starved) > 8 else ""),
        )
    seconds = time.perf_counter() - start
    logger.info("quantized %s -> %s with %s in %.1f s", src, dst, method, seconds)
    return QuantizeReport(dst, method, seconds, config.num_layers, out.total_bytes, tuple(moe_report.rtn_fallback))


def _awq_not_converted(config: ModelConfig) -> list[str] | None:
    """AutoAWQ's ``modules_to_not_convert`` (name substrings) for the 16-bit routers, so that
    AutoAWQ (and vLLM) keep them unquantized: Mixtral's releases say ``["gate"]`` (its experts are
    w1/w2/w3); Qwen MoE needs ``mlp.gate`` (+ ``mlp.shared_expert_gate``), which would also catch a
    dense layer's ``mlp.gate_proj``: written only when every layer is sparse. qserve's loader never
    quantizes a router either way."""
    if not config.moe_layers:
        return None
    if config.family == "mixtral":
        return ["gate"]
    if len(config.moe_layers) < config.num_layers:
        logger.info(
            "%s has dense MLP layers: modules_to_not_convert cannot name the router without naming their "
            "gate_proj, so it is left empty (qserve and vLLM keep routers 16-bit by name; AutoAWQ may not)",
            config.architecture,
        )
        return None
    return ["mlp.gate", "mlp.shared_expert_gate"] if config.shared_expert_intermediate_size else ["mlp.gate"]


def _fp16(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.float16) if tensor.is_floating_point() else tensor
