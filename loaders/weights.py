"""``iter_weights(path, spec)``: stream a checkpoint as canonical weights, one module at a time.

Knows: which tensors belong to one quantized Linear in each format, the layer shapes a
Llama-family ``config.json`` implies (to refuse disagreeing tensors early), and the order in which
to read tensors so that only one layer's raw tensors are in memory at a time. Must not know: the
model classes (it yields HF names; the model routes them) or the device.

Yields ``(module_prefix, PackedQuantWeight)`` for every quantized Linear, e.g.
``("model.layers.0.self_attn.q_proj", packed)``, and ``(param_name, tensor)`` for everything else
(biases, norms, embeddings, unquantized linears' ``.weight``), in their stored dtype.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loaders import awq, compressed_tensors, gptq
from loaders.detect import detect
from loaders.renamed import CheckpointView, RenamedFiles
from loaders.safetensors_io import CheckpointFiles
from loaders.spec import CheckpointSpec, is_quantizable
from quant_kernels.layout import PackedQuantWeight

CONVERTERS = {"gptq": gptq, "awq": awq, "compressed-tensors": compressed_tensors}
_ALL_MAIN_SUFFIXES = (".qweight", ".weight_packed")


def read_config(path: str | Path) -> dict[str, Any]:
    config_path = Path(path) / "config.json"
    return json.loads(config_path.read_text()) if config_path.is_file() else {}


def expected_linear_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """HF Linear module name -> (in_features K, out_features N) for a Llama-family config."""
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config["intermediate_size"])
        layers = int(config["num_hidden_layers"])
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return {}
    moe = config.get("qserve_moe") or {}  # a family adapter's plain-data MoE description
    moe_layers = set(moe.get("layers") or ())
    shapes: dict[str, tuple[int, int]] = {}
    for i in range(layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        shapes[f"{attn}.q_proj"] = (hidden, heads * head_dim)
        shapes[f"{attn}.k_proj"] = (hidden, kv_heads * head_dim)
        shapes[f"{attn}.v_proj"] = (hidden, kv_heads * head_dim)
        shapes[f"{attn}.o_proj"] = (heads * head_dim, hidden)
        if i in moe_layers:
            shapes.update(_moe_linear_shapes(mlp, hidden, moe))
            continue
        shapes[f"{mlp}.gate_proj"] = (hidden, inter)
        shapes[f"{mlp}.up_proj"] = (hidden, inter)
        shapes[f"{mlp}.down_proj"] = (inter, hidden)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head"] = (hidden, vocab)
    return shapes


def _moe_linear_shapes(mlp: str, hidden: int, moe: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(K, N) of one sparse layer's expert linears (and its shared expert's)."""
    inter = int(moe["intermediate_size"])
    gate, up, down = moe.get("expert_names") or ("gate_proj", "up_proj", "down_proj")
    shapes: dict[str, tuple[int, int]] = {}
    for e in range(int(moe["num_experts"])):
        expert = f"{mlp}.experts.{e}"
        shapes[f"{expert}.{gate}"] = shapes[f"{expert}.{up}"] = (hidden, inter)
        shapes[f"{expert}.{down}"] = (inter, hidden)
    shared = int(moe.get("shared_expert_intermediate_size") or 0)
    if shared:
        shapes[f"{mlp}.shared_expert.gate_proj"] = shapes[f"{mlp}.shared_expert.up_proj"] = (hidden, shared)
        shapes[f"{mlp}.shared_expert.down_proj"] = (shared, hidden)
    return shapes


@dataclass(frozen=True, slots=True)
class CheckpointPlan:
    """Which modules of a checkpoint are quantized, and which tensors each one consumes."""

    files: CheckpointFiles | RenamedFiles
    spec: CheckpointSpec
    quantized: dict[str, str]  # module prefix -> name of its main tensor (qweight / weight_packed)
    consumed: frozenset[str]  # tensor names read by quantized converters (not yielded as-is)
    expected: dict[str, tuple[int, int]]  # HF Linear name -> (K, N) implied by config.json


def plan_checkpoint(
    path: str | Path, spec: CheckpointSpec | None = None, view: CheckpointView | None = None
) -> CheckpointPlan:
    """Open the checkpoint (headers only) and cross-check its tensors with the spec and config.

    ``view`` (from ``qserve.model.registry.checkpoint_view``) presents another family's tensors
    under the decoder's Llama names, and its translated config gives the expected shapes.
    """
    spec = spec or detect(path)
    files: CheckpointFiles | RenamedFiles = CheckpointFiles(path)
    if view is not None:
        files = RenamedFiles(files, view, spec.method, spec.bits)
    config = view.config if view is not None else read_config(path)  # the decoder's names and shapes
    expected = expected_linear_shapes(config)
    names = set(files.names())
    stored_quantized = {n.rsplit(".", 1)[0]: n for n in names if n.endswith(_ALL_MAIN_SUFFIXES)}
    quantized: dict[str, str] = {}
    consumed: set[str] = set()
    for prefix, main in sorted(stored_quantized.items()):
        if spec.method == "none":
            raise ValueError(
                f"{files.file_of[main]}: tensor {main!r} is quantized but {spec.source} has no quantization_config"
            )
        quant = spec.module_quant(prefix)
        if quant is None:
            why = "is not a decoder Linear or lm_head" if not is_quantizable(prefix) else "is listed as unquantized"
            raise ValueError(
                f"{files.file_of[main]}: tensor {main!r} is quantized but module {prefix!r} {why} according to "
                f"{spec.source} (modules_to_not_convert / ignore / dynamic / lm_head)"
            )
        converter = CONVERTERS[spec.method]
        if not main.endswith("." + converter.MAIN_SUFFIX):
            raise ValueError(
                f"{files.file_of[main]}: tensor {main!r} does not belong to a {spec.method} checkpoint "
                f"(expected {prefix}.{converter.MAIN_SUFFIX}) as {spec.source} declares"
            )
        quantized[prefix] = main
        consumed.update(f"{prefix}.{s}" for s in converter.SUFFIXES if f"{prefix}.{s}" in names)
    for module, _ in expected.items():
        quant = spec.module_quant(module)
        if quant is not None and module not in quantized:
            if f"{module}.weight" in names:
                raise ValueError(
                    f"{files.file_of[f'{module}.weight']}: module {module!r} is stored unquantized ({module}.weight) "
                    f"but {spec.source} says it is quantized ({quant.bits}-bit)"
                )
            main = CONVERTERS[spec.method].MAIN_SUFFIX
            raise ValueError(f"{files.root}: required tensor '{module}.{main}' is missing from the checkpoint")
        if quant is None and module not in quantized and f"{module}.weight" not in names:
            raise ValueError(f"{files.root}: required tensor '{module}.weight' is missing from the checkpoint")
    for module, main in quantized.items():
        if module not in expected and expected and module != "lm_head":
            raise ValueError(
                f"{files.file_of[main]}: quantized module {module!r} does not exist in config.json's model"
            )
    _check_headers(files, spec, quantized, consumed, config, expected)
    return CheckpointPlan(files, spec, quantized, frozenset(consumed), expected)


_FLOAT_TAGS = ("F16", "BF16", "F32", "F64")


def _dense_shapes(config: dict[str, Any], expected: dict[str, tuple[int, int]]) -> dict[str, tuple[int, ...]]:
    """Shapes of the dense tensors a Llama-family config implies (from its header fields)."""
    try:
        hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return {}
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for module, (k, n) in expected.items():
        shapes[f"{module}.weight"] = (n, k)  # torch orientation [out, in]
    for i in range(int(config.get("num_hidden_layers") or 0)):
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (hidden,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (hidden,)
    return shapes


def _check_headers(
    files: CheckpointFiles,
    spec: CheckpointSpec,
    quantized: dict[str, str],
    consumed: set[str],
    config: dict[str, Any],
    expected: dict[str, tuple[int, int]],
) -> None:
    """Header-only checks (no tensor data read): dense tensors are floating point and have the
    shapes config.json implies; each quantized layer's main tensor is int32, 2-D, and implies
    the layer's (K, N). These are what ``serve`` checks before it starts and what ``inspect``
    reports; the converters check the rest (scales, zeros, g_idx) while loading."""
    from quant_kernels.layout import pack_factor

    dense = _dense_shapes(config, expected)
    for name, info in files.infos.items():
        if name in consumed or name in quantized.values():
            continue
        if info.dtype not in _FLOAT_TAGS and not name.endswith(("g_idx", "weight_shape")):
            raise ValueError(
                f"{info.file}: tensor {name!r} has dtype {info.dtype}; a dense weight must be one of "
                f"{', '.join(_FLOAT_TAGS)}"
            )
        want = dense.get(name)
        if want is not None and tuple(info.shape) != want:
            raise ValueError(
                f"{info.file}: tensor {name!r} has shape {list(info.shape)}, but config.json implies {list(want)}"
            )
    for module, main in quantized.items():
        info = files.infos[main]
        quant = spec.module_quant(module)
        if info.dtype != "I32" or len(info.shape) != 2:
            raise ValueError(
                f"{info.file}: tensor {main!r} has dtype {str(info.torch_dtype).replace('torch.', '')} and shape "
                f"{list(info.shape)}; {spec.method} packs 2-D int32 words"
            )
        want_kn = expected.get(module)
        if quant is None or want_kn is None or spec.method == "compressed-tensors":
            continue  # compressed-tensors stores (N, K) in weight_shape: checked by its converter
        rows, cols = info.shape
        pf = pack_factor(quant.bits)
        got_kn = (rows, cols * pf) if spec.method == "awq" else (rows * pf, cols)
        if got_kn != want_kn:
            layout = f"[K, N/{pf}]" if spec.method == "awq" else f"[K/{pf}, N]"
            raise ValueError(
                f"{info.file}: tensor {main!r} has shape {list(info.shape)}, which as {quant.bits}-bit {spec.method} {layout} means "
                f"K={got_kn[0]}, N={got_kn[1]}, but config.json implies K={want_kn[0]}, N={want_kn[1]} "
                f"(is the checkpoint's format labelled correctly in {spec.source}?)"
            )


def iter_weights(
    path: str | Path,
    spec: CheckpointSpec | None = None,
    view: CheckpointView | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor | PackedQuantWeight]]:
    """Stream every weight of the checkpoint in on-disk order (see the module docstring).

    ``keep``: a weight whose yielded name (module prefix or tensor name) it rejects is not read
    at all (an expert-parallel rank skips the other ranks' experts)."""
    plan = plan_checkpoint(path, spec, view)
    files, spec = plan.files, plan.spec
    main_to_module = {main: module for module, main in plan.quantized.items()}
    order = sorted(files.names(), key=lambda n: (str(files.infos[n].file), files.infos[n].begin))
    try:
        for name in order:
            if keep is not None and not keep(main_to_module.get(name, name)):
                continue
            if name in main_to_module:
                module = main_to_module[name]
                quant = spec.module_quant(module)
                assert quant is not None
                converter = CONVERTERS[spec.method]
                yield module, converter.convert(files, module, quant, spec, plan.expected.get(module))
            elif name in plan.consumed:
                continue
            else:
                yield name, files.get(name)
    finally:
        files.close()
