"""CUDA graph captures run with Python's garbage collected first and the collector off
(``qserve.runner.cuda_graphs.garbage_collected_first``): a collection mid-capture that freed an
earlier engine's graphs or memory invalidated the capture on an H100 (bench/RESULTS.md ledger)."""

from __future__ import annotations

import gc

import pytest
import torch

from qserve.runner.cuda_graphs import garbage_collected_first


class _Cycle:
    freed = 0

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        _Cycle.freed += 1


def test_garbage_is_collected_before_and_the_collector_is_off_inside():
    _Cycle.freed = 0
    _Cycle()  # unreachable at once, freed only by the collector (a cycle)
    assert gc.isenabled()
    with garbage_collected_first():
        assert _Cycle.freed == 1
        assert not gc.isenabled()
        _Cycle()
        for _ in range(3 * gc.get_threshold()[0]):  # allocations that would trigger a collection
            _ = [object()]
        assert _Cycle.freed == 1
    assert gc.isenabled()
    gc.collect()
    assert _Cycle.freed == 2


def test_the_collector_comes_back_after_an_error_and_stays_off_if_it_was():
    with pytest.raises(RuntimeError), garbage_collected_first():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with garbage_collected_first():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engines_whose_graphs_sit_in_garbage_cycles_do_not_break_the_next_capture(tmp_path):
    """Engines with captured graphs dropped inside reference cycles, then a new engine captures its
    graphs with the collector set to run every few allocations: every capture succeeds and the new
    engine generates (before the fix, a collection mid-capture could free the old graphs)."""
    from qserve import LLM
    from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

    path = save_tiny_checkpoint(make_tiny_model("LlamaForCausalLM", seed=5), tmp_path / "ckpt")
    args = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=64, max_num_seqs=8)
    threshold = gc.get_threshold()
    try:
        for _ in range(2):
            old = LLM(str(path), **args)
            old.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)
            holder = {"llm": old}
            holder["self"] = holder  # unreachable only through the collector
            del old, holder
        gc.set_threshold(5)
        llm = LLM(str(path), **args)
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)
        assert out[0].outputs[0].token_ids
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
        torch.cuda.empty_cache()


def test_keep_cache_skips_the_emptying_inside_and_restores_it(monkeypatch):
    from qserve.runner.cuda_graphs import KEEP_CACHE_ENV

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("device"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("host"))
    before = torch.cuda.empty_cache, torch._C._host_emptyCache
    monkeypatch.setenv(KEEP_CACHE_ENV, "1")
    with garbage_collected_first():
        assert calls == ["device", "host"]  # once, for the loop
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()
        with garbage_collected_first():  # a nested loop leaves the outer one's patch alone
            torch.cuda.empty_cache()
        torch.cuda.empty_cache()
        assert calls == ["device", "host"]
    assert (torch.cuda.empty_cache, torch._C._host_emptyCache) == before
    monkeypatch.setenv(KEEP_CACHE_ENV, "0")
    with garbage_collected_first():
        torch.cuda.empty_cache()
    assert calls == ["device", "host", "device"]
    monkeypatch.setenv(KEEP_CACHE_ENV, "yes")
    with pytest.raises(ValueError, match="QSERVE_CAPTURE_KEEP_CACHE='yes'"), garbage_collected_first():
        pass
    assert gc.isenabled()
