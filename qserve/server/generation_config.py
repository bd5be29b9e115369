"""Sampling defaults from a model's ``generation_config.json``, applied as vLLM applies them
(``--generation-config auto``, its default): a request field the client did not send takes
the checkpoint's value.

Knows: which ``generation_config.json`` keys become which request fields (``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``; ``max_new_tokens`` -> ``max_tokens``),
where the file is (``auto``: the model directory; ``vllm``: none; else a directory), and how
"not sent" is told apart from a default (pydantic's ``model_fields_set``). Must not know:
engines, routes, how requests become ``SamplingParams``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_sampling_defaults(source: str, model_path: str) -> dict[str, Any]:
    """The defaults for one model. ``source``: ``auto`` (the model's own file), ``vllm`` (none)
    or a directory holding a ``generation_config.json``. A missing file means no defaults."""
    if source == "vllm":
        return {}
    directory = Path(model_path if source == "auto" else source)
    path = directory / FILE_NAME
    if not path.is_file():
        if source != "auto":
            raise FileNotFoundError(f"--generation-config {source}: no {FILE_NAME} in {directory}")
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    defaults = {key: config[key] for key in _SAMPLING_KEYS if config.get(key) is not None}
    if config.get("max_new_tokens") is not None:
        defaults["max_tokens"] = config["max_new_tokens"]
    if defaults:
        logger.info("sampling defaults from %s: %s", path, defaults)
    return defaults


def apply_sampling_defaults(request: BaseModel, defaults: dict[str, Any]) -> None:
    """Fill the fields of ``request`` that the client did not send from ``defaults``."""
    sent = request.model_fields_set
    for key, value in defaults.items():
        if key == "max_tokens" and "max_completion_tokens" in sent:
            continue
        if key in sent or key not in type(request).model_fields:
            continue
        setattr(request, key, value)
