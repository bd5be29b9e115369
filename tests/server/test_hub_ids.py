"""Hugging Face Hub ids (``org/name``) as model arguments, resolved from a local cache only.

The cache here is built by hand in Hugging Face's layout (``models--org--name/snapshots/<commit>/``
with files linked from ``blobs/``, and ``refs/main`` naming the commit), holding a tiny checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qserve.cli import build_parser, main
from qserve.commands.serve import build_host_factory
from qserve.model.hub import hub_cache_dir, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _fake_cache(root: Path, checkpoint: str, repo: str = "acme/tiny", ref: str = "main") -> Path:
    """``root`` laid out as a Hub cache holding ``checkpoint`` as ``repo``; the snapshot directory."""
    org, name = repo.split("/")
    base = root / f"models--{org}--{name}"
    snapshot = base / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (base / "blobs").mkdir()
    for i, file in enumerate(sorted(Path(checkpoint).iterdir())):
        blob = base / "blobs" / f"blob{i}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (base / "refs").mkdir()
    (base / "refs" / ref).write_text(COMMIT)
    return snapshot


@pytest.fixture
def hub_cache(checkpoints, tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf" / "hub"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return _fake_cache(cache, checkpoints["llama"])


def test_hub_id_resolves_to_the_cached_snapshot(hub_cache, tmp_path, monkeypatch):
    assert hub_cache_dir() == tmp_path / "hf" / "hub"
    assert Path(resolve_model_path("acme/tiny")) == hub_cache
    assert Path(resolve_model_path("acme/tiny", revision=COMMIT)) == hub_cache
    # $HF_HUB_CACHE wins over $HF_HOME
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(FileNotFoundError, match="elsewhere"):
        resolve_model_path("acme/tiny")
    # local paths (existing or not) pass through untouched
    assert resolve_model_path("/no/such/dir") == "/no/such/dir" and resolve_model_path("tiny") == "tiny"


def test_missing_hub_id_is_one_line_naming_id_cache_and_download(hub_cache, capsys):
    assert main(["serve", "acme/absent"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "'acme/absent'" in err and str(hub_cache_dir()) in err and "huggingface-cli download acme/absent" in err
    assert main(["inspect", "acme/tiny", "--revision", "v9"]) == 2
    assert "at revision 'v9'" in capsys.readouterr().err


def test_commands_take_a_hub_id(hub_cache, capsys):
    assert main(["inspect", "acme/tiny", "--headers-only"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    assert main(["plan", "acme/tiny", "--gpu-memory-budget", "1GiB", "--max-model-len", "64"]) == 0
    argv = ["serve", "acme/tiny", "--device=cpu", "--dtype=float32", "--max-model-len=64", "--num-kv-blocks=8"]
    host = build_host_factory(build_parser(argv).parse_args(argv))()
    assert list(host.models) == ["acme/tiny"]  # served under the id, as vLLM does
    assert host.models["acme/tiny"].engine.runner is not None
