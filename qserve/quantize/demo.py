"""The built-in demo model: a tiny Llama trained on Python's standard library, served 4-bit.

Knows: where the committed fp16 demo checkpoint and its calibration text live
(``qserve/recipes/demo/``, package data: a source checkout, an editable and a regular install all
carry it), how to GPTQ-quantize it once into a cache directory
(atomically: a temporary directory renamed into place) and when a cached copy is stale (its stamp
names the source weights' hash and the quantize settings). Must not know: the server.

``qserve serve`` without a model calls ``ensure_demo_model()`` and serves the returned path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from qserve.quantize.pipeline import QuantizeOptions, quantize_checkpoint
from qserve.quantize.recipes import DEMO_CALIB, RECIPES_DIR

logger = logging.getLogger(__name__)

DEMO_DIR = RECIPES_DIR / "demo"
DEMO_MODEL = DEMO_DIR / "model"
DEMO_HELDOUT = DEMO_DIR / "heldout.txt"
CACHE_NAME = "demo-gptq"
STAMP = "qserve_demo.json"
DEMO_OPTIONS = QuantizeOptions(
    method="gptq", bits=4, group_size=128, sym=True, desc_act=False, num_samples=32, seq_len=256, seed=0, device="cpu"
)


def default_cache_root() -> Path:
    """``$QSERVE_CACHE_DIR`` if set, else ``~/.cache/qserve``."""
    env = os.environ.get("QSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qserve"


def demo_source() -> Path:
    if not (DEMO_MODEL / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the demo model is missing: expected {DEMO_MODEL}/model.safetensors (train it with qserve/recipes/demo/train.py)"
        )
    return DEMO_MODEL


def _stamp(source: Path) -> dict[str, object]:
    digest = hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()
    options = DEMO_OPTIONS
    return {
        "source_sha256": digest,
        "method": options.method,
        "bits": options.bits,
        "group_size": options.group_size,
        "num_samples": options.num_samples,
        "seq_len": options.seq_len,
        "seed": options.seed,
        "calib_sha256": hashlib.sha256(DEMO_CALIB.read_bytes()).hexdigest(),
    }


def ensure_demo_model(cache_dir: str | None = None, report: Callable[[str], None] | None = None) -> str:
    """Path of the 4-bit GPTQ demo checkpoint, quantizing it on first use.

    ``cache_dir`` is the cache root (default ``$QSERVE_CACHE_DIR`` or ``~/.cache/qserve``); the
    checkpoint lives in ``<root>/demo-gptq``. A copy made from other weights or settings is
    replaced. Safe against concurrent first runs: each builds in its own temporary directory and
    the first rename wins. ``report`` (e.g. ``print``) is told whether a cached copy is reused or
    a new one is being made, and where.
    """
    source = demo_source()
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    target = root / CACHE_NAME
    stamp = _stamp(source)
    if _is_current(target, stamp):
        if report is not None:
            report(f"using the cached 4-bit demo model in {target} (set QSERVE_CACHE_DIR to move the cache)")
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    message = f"quantizing the demo model to 4-bit GPTQ into {target} (first run only; under a minute on CPU)"
    if report is not None:
        report(message)
    else:
        logger.warning(message)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}-", dir=root))
    try:
        quantize_checkpoint(source, tmp / "ckpt", _options())
        (tmp / "ckpt" / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        if target.exists() and not _is_current(target, stamp):
            stale = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}-stale-", dir=root))
            os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp / "ckpt", target)
        except OSError:
            if not _is_current(target, stamp):  # lost a race to something unexpected
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _options() -> QuantizeOptions:
    return replace(DEMO_OPTIONS, calib=str(DEMO_CALIB))


def _is_current(target: Path, stamp: dict[str, object]) -> bool:
    try:
        return json.loads((target / STAMP).read_text()) == stamp and (target / "config.json").is_file()
    except (OSError, json.JSONDecodeError):
        return False
