"""A set of broken checkpoints, built here: each is refused by ``qserve inspect`` (exit 2) and by
``qserve serve`` (before serving, or while loading) with ONE line that names the file and the
field or tensor, and no traceback unless ``--debug``."""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qserve.cli import build_parser, main
from qserve.commands.serve import build_host_factory
from tests.helpers.quant_packers import (
    awq_config,
    gptq_config,
    quantize_state_dict,
    random_llama_state,
    tiny_llama_config,
    write_checkpoint,
)
from tests.helpers.tokenizer import VOCAB_SIZE, make_tokenizer

Q = "model.layers.0.self_attn.q_proj"


@functools.cache
def _tensors(fmt: str | None) -> dict[str, torch.Tensor]:
    state = random_llama_state(tiny_llama_config(vocab_size=VOCAB_SIZE), dtype=torch.float32)
    return dict(state) if fmt is None else quantize_state_dict(state, fmt, group_size=32).tensors


@functools.lru_cache(maxsize=1)
def _tokenizer_files() -> dict[str, bytes]:
    tmp = Path(tempfile.mkdtemp())
    make_tokenizer(str(tmp))
    files = {p.name: p.read_bytes() for p in tmp.iterdir()}
    shutil.rmtree(tmp)
    return files


def _base(path: Path, *, fmt: str | None = "gptq", config: dict | None = None, edit=None, quant_config=None) -> Path:
    cfg = tiny_llama_config(vocab_size=VOCAB_SIZE, torch_dtype="float32", **(config or {}))
    tensors = dict(_tensors(fmt))
    if fmt == "gptq":
        cfg["quantization_config"] = gptq_config(4, 32)
    if quant_config is not None:
        cfg["quantization_config"] = quant_config
    if edit is not None:
        edit(tensors)
    write_checkpoint(path, cfg, tensors)
    for name, data in _tokenizer_files().items():
        (path / name).write_bytes(data)
    return path


def _set(name: str, value: Callable[[torch.Tensor], torch.Tensor]):
    def edit(tensors):
        tensors[name] = value(tensors[name])

    return edit


def _nan_at_0(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


def _write(rel: str, text: str):
    def after(path: Path) -> None:
        (path / rel).write_text(text)

    return after


def _shard_index_escaping(path: Path) -> None:
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    names = {}
    from loaders.safetensors_io import read_header

    for name in read_header(path / "model-00001-of-00001.safetensors"):
        names[name] = "model-00001-of-00001.safetensors"
    names["model.norm.weight"] = "../../../../../../etc/passwd"
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))


def _missing_shard(path: Path) -> None:
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "nope.safetensors"}})
    )


def _truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _remove(rel: str):
    def after(path: Path) -> None:
        (path / rel).unlink()

    return after


def _pickled_only(path: Path) -> None:
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not really")


def _edit_config(**changes):
    def after(path: Path) -> None:
        cfg = json.loads((path / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        (path / "config.json").write_text(json.dumps(cfg))

    return after


def _extra_file(name: str, tensors: dict[str, torch.Tensor]):
    def after(path: Path) -> None:
        save_file(tensors, str(path / name))

    return after


# id -> (base kwargs, post-write edit or None, needles, caught before serving?)
CASES: dict[str, tuple[dict, Callable[[Path], None] | None, tuple[str, ...], bool]] = {
    "config_not_json": ({}, _write("config.json", "{not json"), ("config.json", "not valid JSON"), True),
    "config_missing_field": ({}, _edit_config(num_attention_heads=None), ("config.json", "num_attention_heads"), True),
    "config_bad_field": ({}, _edit_config(hidden_size="big"), ("config.json", "hidden_size"), True),
    "config_zero_heads": ({}, _edit_config(num_attention_heads=0), ("config.json", "num_attention_heads"), True),
    "architecture": ({}, _edit_config(architectures=["GPT2LMHeadModel"]), ("config.json", "architecture"), True),
    "rope_type": ({}, _edit_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}), ("config.json", "yarn"), True),
    "three_bits": ({"quant_config": gptq_config(3, 32)}, None, ("config.json", "bits"), True),
    "gptq_labelled_awq": ({"quant_config": awq_config(32)}, None, ("model.safetensors", ".qweight", "awq"), True),
    "quantized_without_config": (
        {"quant_config": {}},
        _edit_config(quantization_config=None),
        ("qweight", "quantization_config"),
        True,
    ),
    "no_weights": ({}, _remove("model.safetensors"), ("safetensors",), True),
    "pickled_only": ({}, _pickled_only, ("pytorch_model.bin",), True),
    "truncated": ({}, _truncate, ("model.safetensors", "truncated"), True),
    "corrupt_header": (
        {},
        _write("model.safetensors", "\x10\x00\x00\x00\x00\x00\x00\x00{{{{{{{{{{{{{{{{"),
        ("model.safetensors", "header"),
        True,
    ),
    "shard_escapes_dir": ({}, _shard_index_escaping, ("model.safetensors.index.json", "outside"), True),
    "index_not_json": (
        {},
        _write("model.safetensors.index.json", "[1, 2"),
        ("model.safetensors.index.json", "weight_map"),
        True,
    ),
    "index_missing_shard": ({}, _missing_shard, ("nope.safetensors", "missing"), True),
    "dense_wrong_shape": (
        {"edit": _set("model.embed_tokens.weight", lambda t: t[:-1])},
        None,
        ("model.safetensors", "model.embed_tokens.weight", "shape"),
        True,
    ),
    "dense_wrong_dtype": (
        {"edit": _set("model.norm.weight", lambda t: t.to(torch.int32))},
        None,
        ("model.safetensors", "model.norm.weight", "dtype"),
        True,
    ),
    "missing_dense": ({"edit": lambda t: t.pop("model.norm.weight")}, None, ("model.norm.weight", "missing"), False),
    "qweight_wrong_shape": ({"edit": _set(f"{Q}.qweight", lambda t: t[:, :-1])}, None, (f"{Q}.qweight", "shape"), True),
    "scales_wrong_dtype": (
        {"edit": _set(f"{Q}.scales", lambda t: t.to(torch.int32))},
        None,
        (f"{Q}.scales", "dtype"),
        False,
    ),
    "scales_wrong_shape": ({"edit": _set(f"{Q}.scales", lambda t: t[:, :-1])}, None, (f"{Q}.scales", "shape"), False),
    "nan_scales": (
        {"edit": _set(f"{Q}.scales", _nan_at_0)},
        None,
        ("model.safetensors", f"{Q}.scales", "non-finite"),
        False,
    ),
    "inf_dense": (
        {"edit": _set("model.norm.weight", lambda t: t.clone().fill_(float("inf")))},
        None,
        ("model.norm.weight", "non-finite"),
        False,
    ),
    "nan_embedding_dense_model": (
        {"fmt": None, "edit": _set("model.embed_tokens.weight", _nan_at_0)},
        None,
        ("model.embed_tokens.weight", "non-finite"),
        False,
    ),
    "tokenizer_corrupt": ({}, _write("tokenizer.json", '{"garbage": 1}'), ("tokenizer.json",), True),
    "tokenizer_missing": (
        {},
        lambda p: [(p / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json") if (p / f).exists()],
        ("tokenizer",),
        True,
    ),
}


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("broken")
    paths = {}
    for case, (kwargs, after, _, _) in CASES.items():
        path = _base(root / case, **kwargs)
        if after is not None:
            after(path)
        paths[case] = path
    return paths


def _one_line(err: str, needles: tuple[str, ...]) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


@pytest.mark.parametrize("case", list(CASES))
def test_inspect_refuses_in_one_line(broken, capsys, case):
    _, _, needles, _ = CASES[case]
    assert main(["inspect", str(broken[case])]) == 2
    _one_line(capsys.readouterr().err, needles)


@pytest.mark.parametrize("case", list(CASES))
def test_serve_refuses_before_or_while_loading(broken, case):
    _, _, needles, before_serving = CASES[case]
    argv = ["serve", str(broken[case]), "--device=cpu", "--dtype=float32", "--num-kv-blocks=8", "--max-model-len=64"]
    args = build_parser(argv).parse_args(argv)
    if before_serving:
        with pytest.raises((ValueError, FileNotFoundError)) as info:
            build_host_factory(args)
    else:
        factory = build_host_factory(args)  # the header checks pass; loading refuses it
        with pytest.raises(ValueError) as info:
            factory()
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_inspect_describes_a_weights_only_directory_only_when_asked(broken, capsys):
    """Issue 31: inspect passed a directory without tokenizer files that serve refuses."""
    assert main(["inspect", str(broken["tokenizer_missing"]), "--skip-tokenizer-init"]) == 0
    assert "serving it needs one" in capsys.readouterr().out


def test_debug_shows_the_traceback(broken, capsys):
    assert main(["--debug", "inspect", str(broken["nan_scales"])]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_good_checkpoint_passes(tmp_path, capsys):
    path = _base(tmp_path / "good")
    assert main(["inspect", str(path)]) == 0
    assert "gptq" in capsys.readouterr().out


def test_shard_outside_dir_is_never_opened(broken, monkeypatch):
    opened = []
    real_open = open

    def spy(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy)
    with pytest.raises(ValueError, match="outside"):
        from loaders.safetensors_io import CheckpointFiles

        CheckpointFiles(broken["shard_escapes_dir"])
    assert not any("passwd" in f for f in opened)
