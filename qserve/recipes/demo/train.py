"""Train qserve's built-in demo model: a tiny Llama that writes Python-looking text.

Knows: how to build the demo corpus from the Python standard library's own source (text every
machine with Python has, offline), train a byte-level BPE tokenizer and a small
``LlamaForCausalLM`` on it with plain PyTorch on CPU, and save an fp16 HF checkpoint plus the
held-out and calibration texts next to it. Must not know: qserve internals (the result is an
ordinary HF checkpoint; qserve quantizes and serves it like any other).

Reproducible: a fixed, sorted file list (top-level ``*.py`` of ``sysconfig.get_paths()["stdlib"]``),
fixed held-out / calibration files, a seeded RNG and a fixed number of steps. The exact bytes
depend on the Python version whose stdlib is read (3.11 for the committed model).

Run (about 15-20 minutes on one CPU thread)::

    nice -n 10 python recipes/demo/train.py --out recipes/demo/model
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VOCAB_SIZE = 2048

# Files never trained on; their concatenation is heldout.txt (perplexity evaluation).
HELDOUT_FILES = ("bisect.py", "calendar.py", "fractions.py", "heapq.py", "shlex.py", "textwrap.py")
# Training files whose concatenation is calib.txt (GPTQ / AWQ calibration text).
CALIB_FILES = ("dataclasses.py", "functools.py", "string.py")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def stdlib_files() -> list[Path]:
    """The fixed, sorted corpus: top-level ``*.py`` files of the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "model"))
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    files = stdlib_files()
    names = {p.name for p in files}
    missing = [n for n in HELDOUT_FILES + CALIB_FILES if n not in names]
    if missing:
        raise SystemExit(f"standard library at {files[0].parent} lacks {missing}")
    train_files = [p for p in files if p.name not in HELDOUT_FILES]
    train_texts = [read(p) for p in train_files]
    print(f"corpus: {len(train_files)} training files, {sum(map(len, train_texts)) / 1e6:.1f} MB")

    (HERE / "heldout.txt").write_text("".join(read(p) for p in files if p.name in HELDOUT_FILES), encoding="utf-8")
    (HERE / "calib.txt").write_text("".join(read(p) for p in files if p.name in CALIB_FILES), encoding="utf-8")

    tokenizer = train_tokenizer(train_texts)
    ids: list[int] = []
    for text in train_texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    data = torch.tensor(ids, dtype=torch.long)  # [num_tokens]
    print(f"tokens: {data.numel()} ({sum(map(len, train_texts)) / data.numel():.2f} chars/token)")

    config = model_config(tokenizer)
    model = LlamaForCausalLM(config).float().train()
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f} M parameters")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    start = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + args.seq_len + 1] for s in starts.tolist()])  # [B, T+1]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, vocab]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == args.steps - 1:
            elapsed = time.time() - start
            eta = elapsed / (step + 1) * (args.steps - step - 1)
            print(
                f"step {step:5d}  loss {loss.item():.3f}  lr {lr_at(step):.2e}  {elapsed:6.0f}s  eta {eta:5.0f}s",
                flush=True,
            )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model.eval().to(torch.float16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "training.json").write_text(
        json.dumps(
            {
                "corpus": "top-level *.py files of the Python standard library (sorted), minus held-out files",
                "heldout_files": list(HELDOUT_FILES),
                "calib_files": list(CALIB_FILES),
                "python": sysconfig.get_python_version(),
                "steps": args.steps,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "lr": args.lr,
                "seed": args.seed,
                "final_loss": round(loss.item(), 4),
                "train_seconds": round(time.time() - start),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"saved to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
