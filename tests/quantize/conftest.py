"""Shared fixtures for the quantizer tests: tiny checkpoints, calibration text, a CLI runner.

Knows: how to build small fp16 checkpoints with ``tests.helpers.tiny_models`` and run qserve's
own sub-commands in-process. Must not know: quantizer internals.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

CALIB_TEXT = (
    "The quick brown fox jumps over the lazy dog. A language model predicts the next token.\n"
    "Quantization stores the weights in four bits, and the server streams tokens to the client.\n\n"
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n\n"
) * 40


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quantize")


@pytest.fixture(scope="session")
def calib_file(tiny_root) -> Path:
    path = tiny_root / "calib.txt"
    path.write_text(CALIB_TEXT)
    return path


def tiny_checkpoint(root: Path, arch: str, **overrides) -> Path:
    """A tiny fp16 checkpoint with K, N multiples of 32 (so g32 and the 8-wide packing work)."""
    name = f"{arch}-{'-'.join(f'{k}{v}' for k, v in sorted(overrides.items()))}"
    path = root / name
    if not (path / "config.json").is_file():
        model = make_tiny_model(arch, seed=0, **overrides)
        save_tiny_checkpoint(model, path, dtype=torch.float16)
    return path


@pytest.fixture(scope="session")
def llama_ckpt(tiny_root) -> Path:
    return tiny_checkpoint(tiny_root, "LlamaForCausalLM")


@pytest.fixture(scope="session")
def qwen2_ckpt(tiny_root) -> Path:
    return tiny_checkpoint(tiny_root, "Qwen2ForCausalLM")


def run_command(name: str, argv: list[str]) -> int:
    """Run ``qserve <name> argv`` in-process with the same error handling as ``qserve.cli.main``."""
    module = importlib.import_module(f"qserve.commands.{name.replace('-', '_')}")
    parser = argparse.ArgumentParser(prog=f"qserve {name}")
    module.register(parser)
    args = parser.parse_args(argv)
    return int(module.run(args) or 0)
