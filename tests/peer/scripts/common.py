"""Helpers shared by the peer scripts; importable from any tool venv (torch + transformers only).

Knows: the fixed prompts (token-id lists) and calibration texts every peer run uses, how to build a
tiny random fp16 Llama / Qwen2 with the project's test tokenizer, and how to save reference logits.
Must not know: qserve (these scripts run in the third-party tools' own virtualenvs).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# Token ids < 259 are special tokens (0..2) and single bytes, so they exist in every vocab >= 259.
PROMPTS = [
    [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33],
    [84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110, 32, 102, 111, 120],
    [3, 17, 200, 250, 5, 99, 140, 7, 33, 64, 128, 21],
]

CALIB_TEXTS = [
    "The quick brown fox jumps over the lazy dog. A language model predicts the next token.",
    "Quantization stores the weights in four bits, and the server streams tokens to the client.",
    "Hello world! This is a small test of the tokenizer. The cat sat on the mat in the sun.",
    "We serve many requests at once with continuous batching and paged memory for the cache.",
    "Once upon a time there was a little model that wanted to answer every question quickly.",
    "It is the end of the story, and then there were numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.",
    "Café crème brûlée, naïve façade, résumé, über Straße, Grüße aus München, schön.",
    "The dog ran in the park, and the fox slept under a tree until the evening came again.",
]


def load_tokenizer_module():
    """``tests/helpers/tokenizer.py`` loaded by path (the tool venvs do not install qserve)."""
    path = REPO / "tests" / "helpers" / "tokenizer.py"
    spec = importlib.util.spec_from_file_location("_qserve_test_tokenizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """A tiny random fp16 model (hidden 128, intermediate 256, 2 layers, 4 heads / 2 KV heads)."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer_module().make_tokenizer(str(out))
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    cls_name = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[arch]
    config = getattr(transformers, cls_name[0])(**kwargs)
    config.architectures = [cls_name[1]]
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name[1])(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                # Larger-than-default weights: well-separated logits, so logprob gaps mean something.
                param.normal_(0.0, 0.08 if "embed" not in name else 1.0)
            elif "bias" in name:
                param.normal_(0.0, 0.05)
    model = model.half()
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def save_logits(path: str | Path, logits: list, meta: dict) -> None:
    """Save float32 logits per prompt ([T, V] each) plus metadata as ``.pt``."""
    import torch

    torch.save({"prompts": PROMPTS, "logits": [x.detach().float().cpu() for x in logits], "meta": meta}, str(path))


def print_json(obj: dict) -> None:
    sys.stdout.write("PEER_RESULT " + json.dumps(obj) + "\n")
    sys.stdout.flush()
