"""Which files make a tokenizer on disk, and the error for a directory that has none.

Knows: the file sets a tokenizer loads from (a fast ``tokenizer.json``, a SentencePiece
``tokenizer.model``, a BPE ``vocab.json`` + ``merges.txt``, a WordPiece ``vocab.txt``, a tiktoken
``*.tiktoken`` such as Qwen v1's ``qwen.tiktoken``). Must not know: how any of them is parsed.

Why: a model directory without tokenizer files makes transformers raise "Couldn't instantiate
the backend tokenizer ...", which names neither the directory nor what is missing.
"""

from __future__ import annotations

from pathlib import Path

# Each entry: files that together are a loadable tokenizer.
TOKENIZER_FILE_SETS: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("vocab.json", "merges.txt"),
    ("vocab.txt",),
)
TOKENIZER_SUFFIXES = (".tiktoken",)


class TokenizerFilesError(ValueError):
    """A model directory has no tokenizer, or one that cannot be read."""


def find_tokenizer_files(directory: str | Path) -> list[str]:
    """Names of the tokenizer files present in ``directory`` (empty if there is no tokenizer)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found: list[str] = []
    for names in TOKENIZER_FILE_SETS:
        if all((root / name).is_file() for name in names):
            found.extend(names)
    found.extend(sorted(p.name for p in root.iterdir() if p.is_file() and p.suffix in TOKENIZER_SUFFIXES))
    return found


def expected_files() -> str:
    sets = [" + ".join(names) for names in TOKENIZER_FILE_SETS] + [f"*{s}" for s in TOKENIZER_SUFFIXES]
    return ", ".join(sets)


def check_tokenizer_files(directory: str | Path) -> list[str]:
    """The tokenizer files of ``directory``; ``TokenizerFilesError`` naming it and what is missing if none."""
    found = find_tokenizer_files(directory)
    if not found:
        raise TokenizerFilesError(
            f"{directory}: no tokenizer files (expected one of: {expected_files()}); copy them from the "
            "original model, point tokenizer= / --tokenizer at a directory that has them, or pass "
            "skip_tokenizer_init=True and give prompts as token ids"
        )
    return found
