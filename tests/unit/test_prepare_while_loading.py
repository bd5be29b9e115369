"""Issue 25: a quantized layer's one-time work (fusing its shards, the kernel layout) runs as soon as its last
shard arrives, before the next layer's tensors are read; the loader's weights-pool hook (QSERVE_WEIGHTS_POOL,
on for CUDA) then copies each prepared layer, and the copies compute what the layer did."""

from __future__ import annotations

import pytest
import torch

from bench.e2e import SMALL, write_random_gptq
from qserve.layers.linear import Linear
from qserve.layers.quant_methods import clone_tensors
from qserve.model import llama, loader
from qserve.model.loader import load_model


def _load(path, monkeypatch) -> tuple[torch.nn.Module, list[str]]:
    events: list[str] = []
    real_process, real_load = Linear.process_after_loading, llama.LlamaFamilyForCausalLM.load_weights

    def process(self: Linear) -> None:
        events.append(f"prepare {self.prefix}")
        real_process(self)

    def load_weights(self, weights, **kwargs) -> None:  # noqa: ANN001, ANN003
        def noted():  # noqa: ANN202
            for name, value in weights:
                events.append(f"read {name}")
                yield name, value

        real_load(self, noted(), **kwargs)

    monkeypatch.setattr(Linear, "process_after_loading", process)
    monkeypatch.setattr(llama.LlamaFamilyForCausalLM, "load_weights", load_weights)
    model, _ = load_model(str(path), torch.float16, torch.device("cpu"))
    monkeypatch.undo()
    return model, events


def test_layers_are_prepared_as_their_last_shard_arrives(tmp_path, monkeypatch) -> None:
    write_random_gptq(tmp_path, SMALL)
    model, events = _load(tmp_path, monkeypatch)
    qkv = "prepare model.layers.0.self_attn.qkv_proj"
    # layer 0's qkv right after its v_proj, before anything of layer 1 is read (until issue 25's fix: after
    # the last tensor of the checkpoint)
    v_proj = next(i for i, e in enumerate(events) if e.startswith("read model.layers.0.self_attn.v_proj"))
    first_of_layer1 = next(i for i, e in enumerate(events) if e.startswith("read model.layers.1."))
    assert v_proj < events.index(qkv) < first_of_layer1
    prepared = [e for e in events if e.startswith("prepare")]
    linears = [f"prepare {m.prefix}" for m in model.modules() if isinstance(m, Linear)]
    assert sorted(prepared) == sorted(linears)  # each once
    assert all(not any(s is not None for s in m.quant_shards) for m in model.modules() if hasattr(m, "quant_shards"))


def test_a_weight_given_twice_is_refused(tmp_path, monkeypatch) -> None:
    """A shard that arrives again after its layer was prepared would be dropped (or break the prepare):
    refused, naming the tensor (the review of the early prepare found it)."""
    write_random_gptq(tmp_path, SMALL)
    real = llama.LlamaFamilyForCausalLM.load_weights

    def twice(self, weights, **kwargs) -> None:  # noqa: ANN001, ANN003
        def again():  # noqa: ANN202
            for name, value in weights:
                yield name, value
                if name == "model.layers.0.self_attn.k_proj":
                    yield name, value

        real(self, again(), **kwargs)

    monkeypatch.setattr(llama.LlamaFamilyForCausalLM, "load_weights", twice)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.self_attn\.k_proj: the checkpoint holds this weight twice"
    ):
        load_model(str(tmp_path), torch.float16, torch.device("cpu"))


def test_no_pool_off_cuda_or_when_switched_off(monkeypatch) -> None:
    assert loader._weights_pool("cpu") is None
    monkeypatch.setenv(loader.WEIGHTS_POOL_ENV, "yes")
    assert loader._weights_pool("cpu") is None  # the switch is not read off CUDA (CPU and meta loads)
    monkeypatch.delenv(loader.WEIGHTS_POOL_ENV)
    monkeypatch.setenv(loader.WEIGHTS_POOL_ENV, "0")
    assert loader._weights_pool("cuda") is None
    monkeypatch.setenv(loader.WEIGHTS_POOL_ENV, "yes")
    with pytest.raises(ValueError, match="QSERVE_WEIGHTS_POOL='yes'"):
        loader._weights_pool("cuda")


def test_after_prepare_sees_each_layer_prepared_and_relocation_keeps_the_outputs(tmp_path, monkeypatch) -> None:
    """The loader's weights-pool hook (QSERVE_WEIGHTS_POOL=1 on CUDA): called once per linear, right after
    its prepare; ``relocate`` gives the layer fresh copies of every prepared tensor (shared ones once) and
    the layer computes the same."""
    write_random_gptq(tmp_path, SMALL)
    reference, _ = _load(tmp_path, monkeypatch)
    seen: list[str] = []
    before: dict[str, list[int]] = {}

    def relocate(layer: Linear) -> None:
        assert all(s is None for s in getattr(layer, "quant_shards", [None]))  # prepared: shards released
        seen.append(layer.prefix)
        before[layer.prefix] = [id(t) for t in _tensors(getattr(layer, "quant_prepared", None))]
        layer.relocate()

    monkeypatch.setattr(loader, "_weights_pool", lambda device: "pool")
    monkeypatch.setattr(loader, "_relocate", lambda layer, pool, device: relocate(layer))
    model, _ = load_model(str(tmp_path), torch.float16, torch.device("cpu"))
    linears = [name for name, m in model.named_modules() if isinstance(m, Linear)]
    assert sorted(seen) == sorted(linears) and len(seen) == len(set(seen))
    linears = [name for name in linears if before[name]]  # the quantized ones (the dense lm_head stays)
    assert len(linears) == 4 * SMALL["layers"]
    gen = torch.Generator().manual_seed(1)
    for name in linears:
        layer = model.get_submodule(name)
        assert not set(before[name]) & {id(t) for t in _tensors(layer.quant_prepared)}  # every tensor a new copy
        x = (torch.randn(3, layer.in_features, generator=gen) * 0.1).half()
        torch.testing.assert_close(layer(x), reference.get_submodule(name)(x), rtol=0, atol=0)


def test_clone_tensors_copies_shared_tensors_once() -> None:
    shared = torch.arange(4)
    a, b = clone_tensors([shared, (shared, torch.ones(2))])
    assert a is b[0] and a is not shared and torch.equal(a, shared)


def _tensors(obj) -> list[torch.Tensor]:  # noqa: ANN001
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


def test_the_pool_calls_get_a_device_index(monkeypatch) -> None:
    """torch.cuda.use_mem_pool(pool, device=torch.device("cuda")) raises (an index-less device): the loader
    passes the index, the current device's for plain "cuda" (the review of the weights pool found the call)."""
    used: list[object] = []

    class _Use:
        def __init__(self, pool, device) -> None:  # noqa: ANN001
            used.append((pool, device))

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc) -> None:  # noqa: ANN002
            return None

    class _Layer:
        relocated = 0

        def relocate(self) -> None:
            self.relocated += 1

    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda pool, device=None: _Use(pool, device))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    layer = _Layer()
    loader._relocate(layer, "pool", "cuda")
    loader._relocate(layer, "pool", torch.device("cuda", 1))
    assert used == [("pool", 3), ("pool", 1)] and layer.relocated == 2
