"""Calibration text: the three local sources, seeded windows, and clear errors."""

from __future__ import annotations

import json

import pytest

from qserve.quantize.calibration import calibration_windows, load_texts
from tests.helpers.tokenizer import make_tokenizer


def test_txt_jsonl_and_windows(tmp_path) -> None:
    tok = make_tokenizer()
    txt = tmp_path / "c.txt"
    txt.write_text("first paragraph.\nstill first.\n\nsecond one here.\n\nthird " * 30)
    assert "".join(load_texts(txt)) == txt.read_text()  # split into samples, nothing lost
    assert len(load_texts(txt)) > 30
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"sample number {i} of the set."}) for i in range(50)))
    assert load_texts(jsonl)[3] == "sample number 3 of the set."
    for path in (txt, jsonl):
        a = calibration_windows(path, tok, num_samples=5, seq_len=16, seed=0)
        b = calibration_windows(path, tok, num_samples=5, seq_len=16, seed=0)
        c = calibration_windows(path, tok, num_samples=5, seq_len=16, seed=1)
        assert tuple(a.shape) == (5, 16) and (a == b).all() and not (a == c).all()


def test_missing_file_is_a_clear_error(tmp_path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match=rf"calibration file {missing} does not exist"):
        calibration_windows(missing, make_tokenizer(), 4, 16)


def test_too_small_is_a_clear_error_naming_the_numbers(tmp_path) -> None:
    small = tmp_path / "small.txt"
    small.write_text("tiny text")
    with pytest.raises(
        ValueError, match=rf"{small} is too small: it has \d+ tokens, fewer than one window of --seq-len 512"
    ):
        calibration_windows(small, make_tokenizer(), 128, 512)


def test_bad_jsonl_is_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"content": "no text field"}\n')
    with pytest.raises(ValueError, match=r"line 2: expected an object with a string field 'text'"):
        load_texts(bad)


def test_directory_without_datasets_package(tmp_path, monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):  # noqa: ANN001, ANN202
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ValueError, match=r"is a directory .* but the `datasets` package is not installed"):
        load_texts(tmp_path)
