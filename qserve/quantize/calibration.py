"""Calibration data: local text in, ``[num_samples, seq_len]`` token windows out. Nothing is downloaded.

Knows: three local sources — a ``.txt`` file (split into samples at blank lines, each keeping its
own trailing newlines so the text is tokenized as written), a ``.jsonl`` file (one JSON object per
line with a ``"text"`` field) and a directory saved with ``datasets.save_to_disk`` (read with
``datasets.load_from_disk`` only if that package is installed; a ``"text"`` column) — and how to
cut the tokenized text into windows with a seeded RNG. Must not know: models or quantizers.
"""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_TOKEN_BUDGET_FACTOR = 8  # tokenize at most ~8x the tokens the windows need (large corpora)


def load_texts(path: str | Path) -> list[str]:
    """The calibration samples in ``path`` (see the module docstring for the accepted sources)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(
            f"calibration file {path} does not exist (give a local .txt, .jsonl or saved datasets directory)"
        )
    if path.is_dir():
        return _load_dataset_dir(path)
    if path.suffix == ".jsonl":
        texts = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"calibration file {path}, line {lineno}: not valid JSON ({err})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(
                    f"calibration file {path}, line {lineno}: expected an object with a string field 'text'"
                )
            texts.append(record["text"])
        return [t for t in texts if t]
    text = path.read_text(encoding="utf-8", errors="replace")
    return [t for t in re.split(r"(?<=\n\n)", text) if t]


def _load_dataset_dir(path: Path) -> list[str]:
    try:
        import datasets  # noqa: PLC0415 - optional dependency, imported only for this source
    except ImportError:
        raise ValueError(
            f"calibration path {path} is a directory (a saved `datasets` dataset?) but the `datasets` package is not "
            "installed; install it or pass a .txt / .jsonl file"
        ) from None
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001 - any failure becomes a clear message
        raise ValueError(
            f"calibration directory {path} could not be read with datasets.load_from_disk: {err}"
        ) from None
    if isinstance(data, datasets.DatasetDict):
        split = "train" if "train" in data else next(iter(data))
        data = data[split]
    if "text" not in data.column_names:
        raise ValueError(f"calibration dataset {path} has no 'text' column (columns: {data.column_names})")
    return [t for t in data["text"] if isinstance(t, str) and t]


def calibration_windows(
    path: str | Path,
    tokenizer,
    num_samples: int,
    seq_len: int,
    seed: int = 0,  # noqa: ANN001 - HF tokenizer
) -> torch.Tensor:
    """int64 ``[num_samples, seq_len]`` windows of tokenized calibration text, chosen with ``seed``."""
    if num_samples <= 0 or seq_len <= 0:
        raise ValueError(f"num_samples ({num_samples}) and seq_len ({seq_len}) must be positive")
    texts = load_texts(path)
    needed = num_samples * seq_len
    rng = random.Random(seed)
    separator: list[int] = []
    if Path(path).suffix != ".txt" and getattr(tokenizer, "eos_token_id", None) is not None:
        separator = [int(tokenizer.eos_token_id)]  # documents end with eos; .txt paragraphs flow on
    order = list(range(len(texts)))
    if Path(path).suffix != ".txt":
        rng.shuffle(order)  # a corpus of documents: sample across it, not just its head
    ids: list[int] = []
    for i in order:
        ids.extend(tokenizer(texts[i], add_special_tokens=False)["input_ids"])
        ids.extend(separator)
        if len(ids) >= needed * _TOKEN_BUDGET_FACTOR:
            break
    if len(ids) < seq_len:
        raise ValueError(
            f"calibration file {path} is too small: it has {len(ids)} tokens, fewer than one window of "
            f"--seq-len {seq_len} tokens ({num_samples} windows of {seq_len} tokens = {needed} tokens wanted); "
            "give more text or a smaller --seq-len"
        )
    if len(ids) < needed:
        logger.warning(
            "calibration file %s has %d tokens, fewer than the %d that %d windows of %d need; windows will overlap",
            path,
            len(ids),
            needed,
            num_samples,
            seq_len,
        )
    data = torch.tensor(ids, dtype=torch.int64)  # [num_tokens]
    starts = [rng.randrange(0, len(ids) - seq_len + 1) for _ in range(num_samples)]
    return torch.stack([data[s : s + seq_len] for s in starts])  # [num_samples, seq_len]
