"""A checkpoint view whose tokenizer gives every token id text (issue 27's serving case).

The random benchmark checkpoints carry the tests' small tokenizer, under which most of a 152,064-id
vocabulary decodes to nothing, so a stream sends few chunks. Users' tokenizers cover the whole
vocabulary: every step sends an SSE chunk per sequence, and the front end's per-token work is what
is measured. This writes a word-level tokenizer of ``vocab_size`` entries (id i is the word ``t{i}``,
id 0 the end of text) beside hard links to the checkpoint's weights and config (the loader refuses
shards that resolve outside the checkpoint directory, so not symlinks; a copy across filesystems).

    python3 bench/full_vocab_tokenizer.py SRC_CHECKPOINT DST_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def full_vocab_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    vocab = {EOS: 0} | {f"t{i}": i for i in range(1, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token=EOS)


def write_view(src: Path, dst: Path) -> Path:
    """``dst``: ``src``'s weights and config (hard-linked) with the full-vocabulary tokenizer."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.suffix in (".safetensors", ".json") and "token" not in path.name:
            link = dst / path.name
            if not link.exists():
                try:
                    os.link(path, link)
                except OSError:  # another filesystem
                    shutil.copy2(path, link)
    vocab_size = json.loads((src / "config.json").read_text())["vocab_size"]
    full_vocab_tokenizer(vocab_size).save_pretrained(str(dst))
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(write_view(Path(sys.argv[1]), Path(sys.argv[2])))
