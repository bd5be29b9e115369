"""``detect(path)``: read a checkpoint directory's quantization metadata into a ``CheckpointSpec``.

Knows: where producers put their quantization config (``config.json`` → ``quantization_config``,
``text_config.quantization_config``, legacy ``compression_config``; then ``quantize_config.json``,
``quant_config.json``), the key names and defaults of GPTQ (AutoGPTQ / GPTQModel / optimum), AWQ
(AutoAWQ / GPTQModel) and compressed-tensors configs, and which of their variants qserve
supports. Unsupported variants are refused with a ``ValueError`` naming the file, the field, the
value and what is supported. Must not know: tensor layouts (the converters own them), the engine.

Detection reads metadata only — JSON configs and safetensors headers — never file or folder names.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from loaders.safetensors_io import read_header
from loaders.spec import CheckpointSpec, CTScheme, DynamicRule

logger = logging.getLogger(__name__)

SUPPORTED_BITS = (4, 8)
GPTQ_FORMATS = {"gptq": "v1", "gptq_v2": "v2"}
AWQ_GEMM_VERSIONS = ("gemm", "exllama", "ipex")  # exllama/ipex: transformers' load-time names for GEMM data
AWQ_VERSIONS = ("gemm", "gemv", "gemv_fast", "marlin")
_SUPPORTED_METHODS = "gptq (formats gptq, gptq_v2), awq (version gemm), compressed-tensors (pack-quantized)"
_TAG_TO_DTYPE = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}


def _refuse(source: str, field: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"{source}: {field}={value!r} is not supported; supported: {supported}")


def _load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def find_quant_config(path: str | Path) -> tuple[dict[str, Any] | None, str, dict[str, Any]]:
    """(quantization config or None, where it was found, config.json contents)."""
    root = Path(path)
    config_path = root / "config.json"
    config = _load_json(config_path) if config_path.is_file() else {}
    for key_path in (("quantization_config",), ("text_config", "quantization_config"), ("compression_config",)):
        node: Any = config
        for key in key_path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and node:
            return node, f"{config_path} [{'.'.join(key_path)}]", config
    for fname in ("quantize_config.json", "quant_config.json"):
        file = root / fname
        if file.is_file():
            return _load_json(file), str(file), config
    if not config_path.is_file():
        raise FileNotFoundError(f"{root}: no config.json (is this a Hugging Face model directory?)")
    return None, str(config_path), config


def _check_bits(source: str, field: str, bits: Any) -> int:
    if not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise _refuse(source, field, bits, "4 or 8 bits")
    return bits


def _check_group_size(source: str, field: str, group_size: Any) -> int:
    if group_size is None:
        return -1
    if not isinstance(group_size, int) or (group_size != -1 and group_size <= 0):
        raise _refuse(source, field, group_size, "a positive group size or -1 (per-channel)")
    return group_size


def _flatten(items: Any) -> list[str]:
    if items is None:
        return []
    if isinstance(items, str):
        return [items]
    out: list[str] = []
    for item in items:
        out.extend(_flatten(item))
    return out


def _scale_dtype(root: Path, suffixes: tuple[str, ...]) -> str | None:
    """The dtype of the first scales tensor found in the safetensors headers (metadata only)."""
    try:
        for file in sorted(root.glob("*.safetensors")):
            for name, info in read_header(file).items():
                if name.endswith(suffixes):
                    return _TAG_TO_DTYPE.get(info.dtype, info.dtype)
    except (OSError, ValueError):
        return None
    return None


def _method_of(cfg: dict[str, Any], source: str) -> str:
    method = str(cfg.get("quant_method") or "").lower().replace("_", "-")
    if method == "compressed-tensors":
        return method
    if method in ("gptq", "awq"):
        return method
    if method == "marlin":
        raise _refuse(
            source, "quant_method", cfg.get("quant_method"), _SUPPORTED_METHODS + " (Marlin-serialized GPTQ is not)"
        )
    if method:
        raise _refuse(source, "quant_method", cfg.get("quant_method"), _SUPPORTED_METHODS)
    # No quant_method: AutoGPTQ-style quantize_config.json or AutoAWQ quant_config.json.
    version = str(cfg.get("version") or "").lower()
    if "w_bit" in cfg or "q_group_size" in cfg or "zero_point" in cfg or version in AWQ_VERSIONS:
        return "awq"
    if "bits" in cfg:
        return "gptq"
    raise ValueError(
        f"{source}: cannot tell the quantization method (no 'quant_method' field); supported: {_SUPPORTED_METHODS}"
    )


def _detect_gptq(cfg: dict[str, Any], source: str, root: Path, model_dtype: str | None) -> CheckpointSpec:
    if cfg.get("is_marlin_format"):
        raise _refuse(
            source, "is_marlin_format", cfg["is_marlin_format"], "false (Marlin-serialized GPTQ is not supported)"
        )
    fmt_field = "format" if cfg.get("format") else "checkpoint_format"
    fmt = str(cfg.get(fmt_field) or "gptq").lower()
    other = cfg.get("checkpoint_format")
    if fmt_field == "format" and other and str(other).lower() != fmt:
        logger.warning("%s: format=%r and checkpoint_format=%r disagree; using format", source, fmt, other)
    if fmt not in GPTQ_FORMATS:
        raise _refuse(source, fmt_field, cfg.get(fmt_field), "gptq (v1 zeros), gptq_v2 (v2 zeros)")
    pack_dtype = str(cfg.get("pack_dtype") or "int32").replace("torch.", "")
    if pack_dtype != "int32":
        raise _refuse(source, "pack_dtype", cfg.get("pack_dtype"), "int32")
    bits = _check_bits(source, "bits", cfg.get("bits"))
    group_size = _check_group_size(source, "group_size", cfg.get("group_size", 128))
    sym = cfg.get("sym")
    if sym is None:
        logger.warning("%s: no 'sym' field; assuming sym=True as AutoGPTQ and GPTQModel do", source)
        sym = True
    desc_act = bool(cfg.get("desc_act", False))
    rules: list[DynamicRule] = []
    for key, override in (cfg.get("dynamic") or {}).items():
        skip = key.startswith("-:")
        pattern = key[2:] if key.startswith(("-:", "+:")) else key
        override = override or {}
        field = f"dynamic[{key!r}]"
        o_bits = _check_bits(source, f"{field}.bits", override["bits"]) if "bits" in override else None
        o_group = (
            _check_group_size(source, f"{field}.group_size", override["group_size"])
            if "group_size" in override
            else None
        )
        if not skip and str(override.get("pack_dtype", "int32")).replace("torch.", "") != "int32":
            raise _refuse(source, f"{field}.pack_dtype", override["pack_dtype"], "int32")
        rules.append(
            DynamicRule(
                pattern=pattern,
                skip=skip,
                bits=o_bits,
                group_size=o_group,
                sym=override.get("sym"),
                desc_act=override.get("desc_act"),
            )
        )
    in_block = cfg.get("modules_in_block_to_quantize")
    return CheckpointSpec(
        method="gptq",
        bits=bits,
        group_size=group_size,
        sym=bool(sym),
        desc_act=desc_act,
        zero_convention=GPTQ_FORMATS[fmt],
        scale_dtype=_scale_dtype(root, (".scales",)),
        model_dtype=model_dtype,
        pack_format="gptq",
        lm_head_quantized=bool(cfg.get("lm_head", False)),
        modules_to_not_convert=tuple(_flatten(cfg.get("modules_to_not_convert"))),
        modules_in_block_to_quantize=tuple(_flatten(in_block)) if in_block else None,
        dynamic=tuple(rules),
        source=source,
    )


def _detect_awq(cfg: dict[str, Any], source: str, root: Path, model_dtype: str | None) -> CheckpointSpec:
    version_field = next((f for f in ("version", "format", "checkpoint_format") if cfg.get(f)), "version")
    version = str(cfg.get(version_field) or "gemm").lower()
    if version not in AWQ_GEMM_VERSIONS:
        raise _refuse(source, version_field, cfg.get(version_field), "gemm (AWQ GEMM layout)")
    backend = str(cfg.get("backend") or "").lower()
    if backend == "llm-awq":
        raise _refuse(source, "backend", cfg.get("backend"), "autoawq (GEMM layout); llm-awq packing is not supported")
    bits_field = "bits" if "bits" in cfg else "w_bit"
    bits = cfg.get(bits_field, 4)
    if bits != 4:
        raise _refuse(source, bits_field, bits, "4 bits (AWQ GEMM)")
    group_field = "group_size" if "group_size" in cfg else "q_group_size"
    group_size = _check_group_size(source, group_field, cfg.get(group_field, 128))
    if "zero_point" in cfg:
        zero_point = bool(cfg["zero_point"])
    else:
        zero_point = not bool(cfg.get("sym", False))
    return CheckpointSpec(
        method="awq",
        bits=4,
        group_size=group_size,
        sym=not zero_point,
        desc_act=False,
        zero_convention="v2",
        scale_dtype=_scale_dtype(root, (".scales",)),
        model_dtype=model_dtype,
        pack_format="awq-gemm",
        lm_head_quantized=False,
        modules_to_not_convert=tuple(_flatten(cfg.get("modules_to_not_convert"))),
        source=source,
    )


_ACTORDER_ALIASES = {
    None: None,
    False: None,
    True: "group",
    "group": "group",
    "dynamic": "group",
    "weight": "weight",
    "static": "weight",
}


def _detect_ct(cfg: dict[str, Any], source: str, root: Path, model_dtype: str | None) -> CheckpointSpec:
    transform = cfg.get("transform_config")
    if transform:
        raise _refuse(
            source, "transform_config", transform, "empty or absent (online rotations/transforms are not supported)"
        )
    status = cfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(source, "quantization_status", status, "compressed")
    sparsity = cfg.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise _refuse(source, "sparsity_config.format", sparsity.get("format"), "dense (no sparsity compression)")
    if cfg.get("kv_cache_scheme"):
        raise _refuse(
            source, "kv_cache_scheme", cfg["kv_cache_scheme"], "null (quantized KV cache checkpoints are not supported)"
        )
    global_format = cfg.get("format") or "pack-quantized"
    if global_format not in ("pack-quantized", "mixed-precision"):
        raise _refuse(source, "format", global_format, "pack-quantized")
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{source}: field 'config_groups' is empty; nothing describes the quantized weights")
    schemes: list[CTScheme] = []
    for gname, group in groups.items():
        field = f"config_groups.{gname}"
        fmt = group.get("format") or global_format
        if fmt != "pack-quantized":
            raise _refuse(source, f"{field}.format", fmt, "pack-quantized")
        for act in ("input_activations", "output_activations"):
            if group.get(act):
                raise _refuse(source, f"{field}.{act}", group[act], "null (weight-only W4A16 / W8A16)")
        weights = group.get("weights") or {}
        if weights.get("type", "int") != "int":
            raise _refuse(source, f"{field}.weights.type", weights.get("type"), "int")
        bits = _check_bits(source, f"{field}.weights.num_bits", weights.get("num_bits"))
        if weights.get("dynamic"):
            raise _refuse(source, f"{field}.weights.dynamic", weights["dynamic"], "false")
        strategy = weights.get("strategy")
        if strategy == "group":
            group_size = weights.get("group_size")
            if not isinstance(group_size, int) or group_size <= 0:
                raise _refuse(
                    source, f"{field}.weights.group_size", group_size, "a positive group size with strategy group"
                )
        elif strategy == "channel":
            group_size = -1
        else:
            raise _refuse(source, f"{field}.weights.strategy", strategy, "group, channel")
        actorder = weights.get("actorder")
        if actorder not in _ACTORDER_ALIASES:
            raise _refuse(source, f"{field}.weights.actorder", actorder, "null, group, weight")
        targets = tuple(_flatten(group.get("targets")))
        schemes.append(
            CTScheme(
                gname, targets, bits, group_size, bool(weights.get("symmetric", True)), _ACTORDER_ALIASES[actorder]
            )
        )
    first = schemes[0]
    return CheckpointSpec(
        method="compressed-tensors",
        bits=first.bits,
        group_size=first.group_size,
        sym=first.sym,
        desc_act=first.actorder == "group",
        zero_convention="v2",
        scale_dtype=_scale_dtype(root, (".weight_scale",)),
        model_dtype=model_dtype,
        pack_format="pack-quantized",
        lm_head_quantized=False,  # decided per module by targets/ignore; see CheckpointSpec.module_quant
        ignore=tuple(_flatten(cfg.get("ignore"))),
        ct_schemes=tuple(schemes),
        actorder=first.actorder,
        source=source,
    )


def detect(path: str | Path) -> CheckpointSpec:
    """Read ``path``'s quantization metadata; refuse unsupported variants with a ``ValueError``."""
    root = Path(path)
    cfg, source, config = find_quant_config(root)
    model_dtype = config.get("torch_dtype") or config.get("dtype")
    if isinstance(model_dtype, str):
        model_dtype = model_dtype.replace("torch.", "")
    if cfg is None:
        return CheckpointSpec(method="none", model_dtype=model_dtype, pack_format="dense", source=source)
    method = _method_of(cfg, source)
    if method == "gptq":
        spec = _detect_gptq(cfg, source, root, model_dtype)
    elif method == "awq":
        spec = _detect_awq(cfg, source, root, model_dtype)
    else:
        spec = _detect_ct(cfg, source, root, model_dtype)
        lm_head = spec.module_quant("lm_head") is not None
        if lm_head:
            spec = replace(spec, lm_head_quantized=True)
    return spec
