"""``qserve serve``'s LoRA flags, with vLLM's names: ``--enable-lora``, ``--lora-modules``,
``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``.

Knows: the flags' syntax (``--lora-modules name=path`` or vLLM's JSON form
``'{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}'``, several after one flag),
their checks before anything loads (each adapter's ``adapter_config.json`` read and checked against
``--max-lora-rank``; names unique and not a model's; the base model named or the only one), and how
the adapters are registered once the engines exist (or handed to an engine core in its own process). Must not know: routes, how an adapter is applied.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qserve.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def register_lora_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters on top of the model")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help='adapters served under their own names: NAME=PATH or \'{"name": ..., "path": ..., '
        '"base_model_name": ...}\' (PEFT adapter directories); requests address them by model name',
    )
    group.add_argument("--max-loras", type=int, default=1, help="adapters resident on the device at once (default 1)")
    group.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank served (default 16)")
    group.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept loaded in host memory (default: --max-loras)"
    )


def parse_lora_modules(values: list[str]) -> list[LoRAModule]:
    modules = []
    for value in values:
        text = value.strip()
        if text.startswith("{"):
            try:
                item = json.loads(text)
            except ValueError:
                raise ValueError(f"--lora-modules {value!r}: not valid JSON") from None
            unknown = sorted(set(item) - {"name", "path", "base_model_name"})
            if unknown:
                raise ValueError(
                    f"--lora-modules {value!r}: unknown field(s) {unknown}; use name, path, base_model_name"
                )
            for field in ("name", "path"):
                if not isinstance(item.get(field), str) or not item[field]:
                    raise ValueError(f"--lora-modules {value!r}: field {field!r} must be a non-empty string")
            modules.append(LoRAModule(item["name"], item["path"], item.get("base_model_name")))
            continue
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: use NAME=PATH or the JSON form")
        modules.append(LoRAModule(name, path))
    return modules


def check_lora_flags(args: argparse.Namespace, model_names: list[str]) -> list[LoRAModule]:
    """The adapters to register, checked (ValueError naming the flag and field)."""
    from qserve.lora.peft import check_adapter_config, read_adapter_config
    from qserve.lora.request import LoRAConfig

    modules = parse_lora_modules(getattr(args, "lora_modules", []) or [])
    if not getattr(args, "enable_lora", False):
        if modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return []
    try:
        config = LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)
    except ValueError as err:
        raise ValueError(f"--{str(err).replace('_', '-')}") from None
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: adapter names must be unique, got {names}")
    for module in modules:
        if module.name in model_names:
            raise ValueError(f"--lora-modules: adapter name {module.name!r} is the name of a served model")
        base = module.base_model_name
        if base is not None and base not in model_names:
            raise ValueError(
                f"--lora-modules {module.name}: base_model_name {base!r} is not served; models: {', '.join(model_names)}"
            )
        if base is None and len(model_names) > 1:
            raise ValueError(
                f"--lora-modules {module.name}: several models are served; give base_model_name (JSON form)"
            )
        check_adapter_config(read_adapter_config(Path(module.path)), Path(module.path), config.max_lora_rank)
    return modules


def lora_module_requests(modules: list[LoRAModule], model_names: list[str]) -> list[LoRARequest]:
    """The adapters of ``--lora-modules`` as ``LoRARequest``s (ids 1, 2, ... in flag order), each
    naming its base model (the one given, or the first served)."""
    from qserve.lora.request import LoRARequest

    return [
        LoRARequest(module.name, i + 1, module.path, module.base_model_name or model_names[0])
        for i, module in enumerate(modules)
    ]


def register_lora_modules(host: object, modules: list[LoRAModule]) -> None:
    """Register the adapters with their base models' engines (after the build, before serving).
    An engine core in its own process loaded them itself (``CoreConfig.lora_modules``)."""
    if hasattr(host, "lora_adapters"):
        return
    for request in lora_module_requests(modules, list(host.models)):  # type: ignore[attr-defined]
        host.models[request.base_model_name].engine.add_lora(request)  # type: ignore[attr-defined]
