"""Tiny tokenizer files of the non-Llama families, built in-test (no downloads).

Knows: the ``.tiktoken`` file format (``base64(bytes) rank`` lines; every multi-byte token is a
merge of two lower-ranked tokens) and how to train a small SentencePiece model in memory. Must
not know: qserve internals.
"""

from __future__ import annotations

import base64
import io
from collections import Counter
from pathlib import Path

import regex

TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello world! You are a helpful assistant.\n"
    "Quantization stores weights in four bits; the server streams tokens. 12345 67890 2026\n"
    "你好，世界。我们喜欢模型。 Café crème brûlée, naïve résumé. user assistant system\n"
) * 3


def bpe_ranks(text: str, pattern: str, num_merges: int) -> dict[bytes, int]:
    """Byte-level BPE: 256 single bytes, then the most frequent adjacent pair, ``num_merges`` times."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in piece.encode()] for piece in regex.findall(pattern, text)]
    for _ in range(num_merges):
        pairs = Counter((w[i], w[i + 1]) for w in words for i in range(len(w) - 1))
        if not pairs:
            break
        (left, right), _ = pairs.most_common(1)[0]
        ranks[left + right] = len(ranks)
        merged_words = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == left and w[i + 1] == right:
                    out.append(left + right)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged_words.append(out)
        words = merged_words
    return ranks


def write_tiktoken(path: Path, ranks: dict[bytes, int]) -> Path:
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda x: x[1])]
    path.write_text("\n".join(lines) + "\n")
    return path


def train_sentencepiece(vocab_size: int = 400, **options) -> bytes:
    """A small SentencePiece model (serialized proto) trained on ``TEXT``."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.splitlines() * 4),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
        **options,
    )
    return model.getvalue()
