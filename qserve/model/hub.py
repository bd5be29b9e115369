"""Hugging Face Hub ids as model arguments, resolved from the local cache only (offline-safe).

Knows: when a model argument is a Hub id (``org/name`` that is not an existing path), where the
Hugging Face cache is (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``,
read at every call, as ``huggingface_hub`` reads them at import), and how to find a cached
snapshot of a revision (a branch or tag through ``refs/``, or a commit hash) with
``snapshot_download(..., local_files_only=True)``: nothing is ever downloaded. Must not know:
what is in a checkpoint, or which command asks.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

# org/name as the Hub spells repository ids: letters, digits, '-', '_', '.'; one slash.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def add_revision_argument(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``--revision``: which cached revision of a Hub id (a branch, tag or commit)."""
    parser.add_argument(
        "--revision",
        default=None,
        help="for a Hugging Face Hub id (org/name): the branch, tag or commit of its cached snapshot (default main)",
    )


def hub_cache_dir() -> Path:
    """The Hub cache ``huggingface_hub`` would use under the current environment."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = str(Path(xdg) / "huggingface")
    return Path(home).expanduser() / "hub"


def is_hub_id(value: str) -> bool:
    """``org/name`` that is not an existing path (an existing directory always wins)."""
    return bool(_HUB_ID.match(value)) and not Path(value).exists()


def resolve_model_path(value: str, revision: str | None = None) -> str:
    """A local path for a model argument: ``value`` itself unless it is a Hub id, else the
    directory of its cached snapshot. FileNotFoundError (one line: the id, the cache looked in,
    the command that downloads it) when the cache does not hold it."""
    if not is_hub_id(value):
        return value
    cache = hub_cache_dir()
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # transformers depends on it; kept for a stripped environment
        snapshot_download = None
    if snapshot_download is not None:
        try:
            return snapshot_download(value, revision=revision, cache_dir=str(cache), local_files_only=True)
        except Exception:  # noqa: BLE001 - huggingface_hub's "not cached" errors vary by version
            pass
    at = f" at revision {revision!r}" if revision else ""
    download = f"huggingface-cli download {value}" + (f" --revision {revision}" if revision else "")
    raise FileNotFoundError(
        f"model {value!r}{at} is neither a local directory nor in the Hugging Face cache {cache} "
        f"(HF_HUB_CACHE / HF_HOME); download it first: {download}"
    )
