"""Loading a checkpoint's tokenizer, with errors that say which directory lacks which files.

Knows: which files make up a tokenizer on disk (a fast ``tokenizer.json``, a SentencePiece
``tokenizer.model``, a BPE ``vocab.json`` + ``merges.txt``, a WordPiece ``vocab.txt``, a tiktoken
``*.tiktoken``), and how to ask transformers' ``AutoTokenizer`` for it. Must not know: the
engine, prompts or detokenization.

Why a check of our own: a model directory without tokenizer files makes transformers raise
"Couldn't instantiate the backend tokenizer ...", which names neither the directory nor what is
missing. Callers that only feed token ids can skip the tokenizer altogether
(``LLM(..., skip_tokenizer_init=True)``, as in vLLM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Each entry: files that together are a loadable tokenizer.
TOKENIZER_FILE_SETS: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("vocab.json", "merges.txt"),
    ("vocab.txt",),
)
TOKENIZER_SUFFIXES = (".tiktoken",)


class TokenizerFilesError(ValueError):
    """A model directory has no tokenizer, or one transformers cannot read."""


def find_tokenizer_files(directory: Path) -> list[str]:
    """Names of the tokenizer files present in ``directory`` (empty if there is no tokenizer)."""
    found: list[str] = []
    for names in TOKENIZER_FILE_SETS:
        if all((directory / name).is_file() for name in names):
            found.extend(names)
    found.extend(sorted(p.name for p in directory.iterdir() if p.is_file() and p.suffix in TOKENIZER_SUFFIXES))
    return found


def _expected() -> str:
    sets = [" + ".join(names) for names in TOKENIZER_FILE_SETS] + [f"*{s}" for s in TOKENIZER_SUFFIXES]
    return ", ".join(sets)


def load_tokenizer(path: str) -> Any:
    """``AutoTokenizer.from_pretrained(path)`` for a local directory, checked first.

    Raises ``TokenizerFilesError`` naming the directory and the missing files when there is no
    tokenizer, and naming the directory and transformers' reason when the files do not load.
    """
    from transformers import AutoTokenizer

    directory = Path(path)
    if directory.is_dir():
        if not find_tokenizer_files(directory):
            raise TokenizerFilesError(
                f"{directory}: no tokenizer files (expected one of: {_expected()}); copy them from the "
                "original model, point tokenizer= / --tokenizer at a directory that has them, or pass "
                "skip_tokenizer_init=True and give prompts as token ids"
            )
        try:
            return AutoTokenizer.from_pretrained(str(directory))
        except Exception as err:  # noqa: BLE001 - any failure here is a bad tokenizer on disk
            present = ", ".join(find_tokenizer_files(directory))
            raise TokenizerFilesError(
                f"{directory}: the tokenizer ({present}) could not be loaded: {type(err).__name__}: {err}"
            ) from err
    return AutoTokenizer.from_pretrained(path)
