"""Tokenizer loading for every family, without remote code.

Knows: which tokenizer files each family ships and which builder reads them: Qwen v1's
``qwen.tiktoken`` (``qserve.tokenization.qwen``), ChatGLM's and Baichuan's SentencePiece
``tokenizer.model`` when no ``tokenizer.json`` is there (``qserve.tokenization.spm``); everything
else goes to ``transformers.AutoTokenizer``, always with ``trust_remote_code=False``: a directory
whose ``auto_map`` names custom tokenizer code never reaches transformers' interactive "run the
custom code? [y/N]" prompt (on a terminal, ``y`` ran the directory's code); it loads with a
built-in class or is refused with ``RemoteCodeError``. qserve never runs a model directory's
code (vLLM's ``--trust-remote-code`` is not offered). Must not know: the engine or models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qserve.tokenization.files import TokenizerFilesError, check_tokenizer_files


def _architectures(root: Path) -> list[str]:
    config = root / "config.json"
    if not config.is_file():
        return []
    try:
        return list(json.loads(config.read_text()).get("architectures") or [])
    except (json.JSONDecodeError, AttributeError):
        return []


STOP_IDS_ATTR = "qserve_stop_token_ids"


class RemoteCodeError(TokenizerFilesError):
    """The tokenizer exists only as code shipped in the model directory (``auto_map``)."""


def auto_tokenizer(name_or_path: str) -> Any:
    """``AutoTokenizer.from_pretrained`` that never runs or prompts for the model's own code."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise RemoteCodeError(
            f"{name_or_path}: the tokenizer is custom code named by auto_map in tokenizer_config.json / config.json; "
            "qserve never runs code from a model directory (vLLM's --trust-remote-code is not offered): "
            "use a checkpoint whose tokenizer.json loads with a built-in transformers class"
        ) from None


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """Chat stop ids a family's builder declared beyond ``eos_token_id`` (Qwen v1: <|im_end|>,
    <|im_start|>; ChatGLM3: <|user|>, <|observation|>); empty for other tokenizers."""
    return tuple(getattr(tokenizer, STOP_IDS_ATTR, ()))


def num_token_ids(tokenizer: Any) -> int:
    """One past the largest id ``tokenizer`` can produce, added and special tokens included
    (vLLM's ``max_token_id + 1``). Model rows at or past it hold no token."""
    vocab = tokenizer.get_vocab()
    return max(len(tokenizer), max(vocab.values(), default=-1) + 1)


def load_tokenizer(path: str | Path) -> Any:
    """A ``transformers`` fast tokenizer for the checkpoint (or tokenizer) directory ``path``.

    A directory without tokenizer files, or with files that do not load, raises
    ``TokenizerFilesError`` naming the directory and the files (and the reason).
    """
    root = Path(path)
    if not root.is_dir():
        return auto_tokenizer(str(path))
    present = check_tokenizer_files(root)
    try:
        return _load_from_directory(root)
    except TokenizerFilesError:  # RemoteCodeError included
        raise
    except Exception as err:  # noqa: BLE001 - tokenizer libraries raise many kinds (KeyError, OSError, ...)
        detail = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        raise TokenizerFilesError(
            f"{root}: the tokenizer ({', '.join(present)}) could not be loaded: {detail}"
        ) from err


def _load_from_directory(root: Path) -> Any:
    if (root / "qwen.tiktoken").is_file():
        from qserve.tokenization import qwen  # noqa: PLC0415

        return qwen.load(root)
    if (root / "tokenizer.model").is_file() and not (root / "tokenizer.json").is_file():
        from qserve.tokenization import spm  # noqa: PLC0415

        archs = _architectures(root)
        if any(a.startswith("ChatGLM") or a == "BaichuanForCausalLM" for a in archs):
            spm.check_model_file(root / "tokenizer.model")
        if any(a.startswith("ChatGLM") for a in archs):
            return spm.load_chatglm(root)
        if "BaichuanForCausalLM" in archs:
            return spm.load_baichuan(root)
    return auto_tokenizer(str(root))
