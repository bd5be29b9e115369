"""qserve asks for expandable CUDA allocator segments where the user has not configured the allocator
(``qserve.runner.cuda_allocator``), at the moment it resolves a CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

from qserve.engine.engine import resolve_device
from qserve.runner import cuda_allocator


def test_sets_expandable_segments_when_unset() -> None:
    environ: dict[str, str] = {}
    with mock.patch.object(torch.cuda, "is_initialized", lambda: False):
        assert cuda_allocator.prefer_expandable_segments(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize("name", cuda_allocator.ALLOC_CONF_ENVS)
@pytest.mark.parametrize("value", ["expandable_segments:False", "max_split_size_mb:512", ""])
def test_a_users_setting_wins(name: str, value: str) -> None:
    """Either of torch's names, whatever the value (an empty one too), is the user's choice."""
    environ = {name: value}
    with mock.patch.object(torch.cuda, "is_initialized", lambda: False):
        assert not cuda_allocator.prefer_expandable_segments(environ)
    assert environ == {name: value}


def test_nothing_once_cuda_has_started() -> None:
    """The allocator has read its settings: setting the variable then would only mislead children."""
    environ: dict[str, str] = {}
    with mock.patch.object(torch.cuda, "is_initialized", lambda: True):
        assert not cuda_allocator.prefer_expandable_segments(environ)
    assert environ == {}


def test_resolve_device_asks_for_cuda_only() -> None:
    """Resolving a CUDA device sets it (creating a ``torch.device`` starts nothing, so no GPU is needed
    here); a CPU engine leaves the environment alone."""
    with mock.patch.dict(os.environ, clear=False), mock.patch.object(torch.cuda, "is_initialized", lambda: False):
        for name in cuda_allocator.ALLOC_CONF_ENVS:
            os.environ.pop(name, None)
        assert resolve_device("cpu").type == "cpu"
        assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
        assert resolve_device("cuda").type == "cuda"
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


_PROBE = """
import torch
from qserve.engine.engine import resolve_device
device = resolve_device(None)
x = torch.empty(64 << 20, dtype=torch.uint8, device=device)
print(sorted({bool(s.get("is_expandable")) for s in torch.cuda.memory._snapshot()["segments"]}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("user_setting", [None, "expandable_segments:False"])
def test_engine_process_allocates_expandable_segments(user_setting: str | None) -> None:
    """On a GPU, in a fresh process (CUDA not yet started): the allocator's segments are expandable
    after ``resolve_device``, and stay fixed where the user said so."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    env = {k: v for k, v in os.environ.items() if k not in cuda_allocator.ALLOC_CONF_ENVS}
    if user_setting is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = user_setting
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == ("[True]" if user_setting is None else "[False]"), out.stdout


def test_allocator_setting_names_what_the_allocator_reads() -> None:
    """The start-up log line: the first of torch's two names that is set, else torch's default."""
    assert cuda_allocator.allocator_setting({}) == "torch's default (fixed-size segments)"
    assert cuda_allocator.allocator_setting({"PYTORCH_ALLOC_CONF": ""}) == "PYTORCH_ALLOC_CONF=''"
    both = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "x"}
    assert cuda_allocator.allocator_setting(both) == "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True'"
