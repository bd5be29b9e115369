"""``check_checkpoint(path)``: the checks ``qserve serve`` and ``qserve inspect`` share, run
before anything is served.

Knows: which checks exist and their order: ``config.json`` (JSON, fields, architecture),
quantization metadata (``loaders.detect``), tensor headers against the config and the format
(``loaders.plan_checkpoint``), the tokenizer, and, when asked, every tensor streamed through
the same converters and model routing that serving uses, on the ``meta`` device (shapes and
dtypes of scales / zeros / g_idx, non-finite values) without keeping any weight in memory.
Must not know: the engine, the server, the CLI's output.

Every failure is a ``ValueError`` (or ``FileNotFoundError``) whose one-line message names the
file and the field or tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import loaders
from qserve.config import ModelConfig
from qserve.model.registry import checkpoint_view, read_model_config
from qserve.tokenization import load_tokenizer


@dataclass(frozen=True, slots=True)
class CheckedCheckpoint:
    path: Path
    config: ModelConfig
    spec: loaders.CheckpointSpec


def check_tokenizer(path: str | Path) -> None:
    """Load the tokenizer the engine will load (every family's); a failure names the directory and
    its tokenizer files (``TokenizerFilesError``, a ValueError)."""
    load_tokenizer(path)


def check_checkpoint(path: str | Path, *, tokenizer: bool = True, tensors: bool = False) -> CheckedCheckpoint:
    """Run the checks (see the module docstring); ``tensors=True`` also reads every tensor."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a directory (expected a Hugging Face model directory)")
    config = read_model_config(root)
    spec = loaders.detect(root)
    # Other families' tensors are checked under the decoder's names, as the loader will read them.
    plan = loaders.plan_checkpoint(root, spec, checkpoint_view(config.raw, str(root / "config.json")))
    plan.files.close()
    if tokenizer:
        check_tokenizer(root)
    if tensors:
        from qserve.model.loader import load_model

        load_model(root, config.dtype, "meta")
    return CheckedCheckpoint(root, config, spec)
