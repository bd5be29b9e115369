"""Multi-LoRA through the engine (CPU, tiny models): each adapter equals the dequantized base with the
adapter merged into it, a batch mixing adapters and the base equals each request run alone, slots and
host copies swap LRU, prefix caching never crosses adapters, adapters load and unload while requests
run, and unservable adapters are refused with a message naming the field.

One GPTQ 4-bit engine (float32 compute, so the only differences to the float reference are
summation order) serves 5 adapters with ``max_loras=4`` slots and ``max_cpu_loras=4`` host copies:
a batch of all of them makes the scheduler hold the fifth back, a slot change hands it one, and one
adapter is read again from its directory.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qserve import LLM, LoRARequest, SamplingParams
from qserve.memory.planner import lora_slot_bytes
from qserve.runner.cuda_graphs import DecodeGraphs
from tests.helpers.lora_adapters import merged_state_dict, projection_shapes, write_peft_adapter
from tests.helpers.quant_packers import gptq_config, quantize_state_dict, write_checkpoint

transformers = pytest.importorskip("transformers")

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
SHAPES = projection_shapes(64, 128, 4, 2, 16)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (targets, rank, alpha, rsLoRA, only these layers)
ADAPTERS = {
    "all-r8": (ALL, 8, 16, False, None),
    "qv-r4": (("q_proj", "v_proj"), 4, 8, False, None),
    "mlp-r16-rs": (("gate_proj", "up_proj", "down_proj"), 16, 32, True, None),
    "attn-r2": (("k_proj", "o_proj"), 2, 4, False, (1,)),
    "up-r8": (("up_proj", "q_proj"), 8, 8, False, None),
}
PROMPTS = [[(7 * i + 3 * j + 1) % 256 for i in range(10 + 3 * j)] for j in range(7)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(LLM, {name: LoRARequest}, {name: reference HF model}, base reference)"""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMALL)
    config.architectures = ["LlamaForCausalLM"]
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    state = {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}
    qm = quantize_state_dict(state, "gptq", group_size=32)
    config_dict = config.to_dict() | {"quantization_config": gptq_config(4, 32, sym=True), "torch_dtype": "float32"}
    config_dict.pop("dtype", None)
    write_checkpoint(root / "base", config_dict, qm.tensors)
    dequant = {k: v for k, v in qm.tensors.items() if k in state}
    dequant.update({f"{m}.weight": w for m, w in qm.dequant.items()})
    references, requests = {}, {}
    for i, (name, (targets, rank, alpha, rs, layers)) in enumerate(ADAPTERS.items()):
        written = write_peft_adapter(
            root / name, SHAPES, 2, targets=targets, rank=rank, alpha=alpha, use_rslora=rs, seed=i, layers=layers
        )
        ref = transformers.LlamaForCausalLM(config).float().eval()
        ref.load_state_dict(merged_state_dict(dequant, written), strict=False)
        references[name] = ref
        requests[name] = LoRARequest(name, i + 1, str(root / name))
    base = transformers.LlamaForCausalLM(config).float().eval()
    base.load_state_dict(dequant, strict=False)
    references[None] = base
    llm = LLM(
        str(root / "base"),
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=16,
        max_cpu_loras=4,
        num_kv_blocks=64,
        max_num_seqs=16,
    )
    return llm, requests, references, root


def _reference(model, prompt: list[int], max_tokens: int) -> tuple[list[float], list[int]]:
    """(prompt logprobs of tokens 1.., greedy tokens) of an HF model."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].double(), -1)
        prompt_lp = [logprobs[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
        for _ in range(max_tokens):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return prompt_lp, ids[0, len(prompt) :].tolist()


PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=0)


def _prompt_lp(output) -> list[float]:
    return [next(iter(pos.values())).logprob for pos in output.prompt_logprobs[1:]]


@pytest.mark.slow
def test_mixed_batch_matches_merged_reference_and_solo_runs(setup) -> None:
    llm, requests, references, _ = setup
    names = [*ADAPTERS, None, None]
    loras = [None if n is None else requests[n] for n in names]
    mixed = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False, lora_request=loras)
    for prompt, name, lora, out in zip(PROMPTS, names, loras, mixed):
        want_lp, want_tokens = _reference(references[name], prompt, PARAMS.max_tokens)
        assert out.outputs[0].token_ids == want_tokens, name
        assert max(abs(a - b) for a, b in zip(_prompt_lp(out), want_lp)) < 2e-4, name
        (solo,) = llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False, lora_request=lora)
        assert solo.outputs[0].token_ids == out.outputs[0].token_ids, name
        assert max(abs(a - b) for a, b in zip(_prompt_lp(solo), _prompt_lp(out))) < 1e-5, name
    manager = llm.engine.lora_manager
    assert len(manager.resident_names()) == 4  # five adapters went through four slots
    # 2 layers x 4 slots x float32 x (A + B of qkv, o, gate_up, down), and the planner's arithmetic (what
    # the memory plan and the shared pool set aside) agrees.
    per_layer = 3 * 16 * 64 + 128 * 16 + 16 * 64 + 64 * 16 + 2 * 16 * 64 + 256 * 16 + 16 * 128 + 64 * 16
    assert manager.nbytes == 2 * 4 * 4 * per_layer == lora_slot_bytes(llm.engine.model_config, 4, 16, torch.float32)


def test_adapters_change_outputs(setup) -> None:
    """A control for the equalities above: each adapter's logprobs differ from the base model's
    (one prompt under every adapter and the base, in one batch)."""
    llm, requests, _, _ = setup
    loras = [None, *(requests[name] for name in ADAPTERS)]
    base, *outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}] * len(loras), PARAMS, use_tqdm=False, lora_request=loras
    )
    for name, out in zip(ADAPTERS, outs):
        assert max(abs(a - b) for a, b in zip(_prompt_lp(out), _prompt_lp(base))) > 1e-3, name


def test_prefix_cache_is_keyed_by_adapter(setup) -> None:
    llm, requests, _, _ = setup
    prompt = {"prompt_token_ids": [(11 * i + 5) % 256 for i in range(40)]}  # two full blocks of 16
    params = SamplingParams(max_tokens=1, temperature=0.0)
    a, b = requests["all-r8"], requests["qv-r4"]
    first = llm.generate(prompt, params, use_tqdm=False, lora_request=a)[0]
    assert first.num_cached_tokens == 0 and first.lora_request == a  # vLLM's RequestOutput.lora_request
    assert llm.generate(prompt, params, use_tqdm=False, lora_request=b)[0].num_cached_tokens == 0
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0  # the base model
    again = llm.generate(prompt, params, use_tqdm=False, lora_request=a)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_load_and_unload_while_requests_run(setup) -> None:
    """Requests on an adapter removed mid-generation finish with it; a new adapter loaded mid-run
    serves at once; nobody is lost and every output equals its undisturbed run."""
    llm, requests, _, root = setup
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    late = LoRARequest("late", 99, str(root / "up-r8"))
    work = [("r0", PROMPTS[1], requests["qv-r4"]), ("r1", PROMPTS[2], None), ("r2", PROMPTS[3], requests["qv-r4"])]
    for rid, prompt, lora in work:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params, lora_request=lora)
    outputs = {}
    for step in range(200):
        if step == 2:
            assert engine.remove_lora("qv-r4")
            assert "qv-r4" not in engine.list_loras()
            engine.add_lora(late)
            engine.add_request("r3", {"prompt_token_ids": PROMPTS[4]}, params, lora_request=late)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        if step == 1:  # what vllm:lora_requests_info reports: adapters by name, never the base model
            assert engine.lora_stats() == (["qv-r4"], [])
        if not engine.has_unfinished_requests():
            break
    assert sorted(outputs) == ["r0", "r1", "r2", "r3"]
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs.values())
    assert engine.lora_manager.lookup("qv-r4") is None
    solo = [(PROMPTS[1], requests["qv-r4"], "r0"), (PROMPTS[2], None, "r1"), (PROMPTS[4], late, "r3")]
    for prompt, lora, rid in solo:
        (want,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=lora)
        assert outputs[rid].outputs[0].token_ids == want.outputs[0].token_ids, rid
    engine.remove_lora("late")


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"use_dora": True}, "'use_dora'"),
        ({"r": 32}, "'r'"),
        ({"bias": "all"}, "'bias'"),
        ({"modules_to_save": ["lm_head"]}, "'modules_to_save'"),
        ({"peft_type": "IA3"}, "'peft_type'"),
        ({"rank_pattern": {"q_proj": 4}}, "'rank_pattern'"),
    ],
)
def test_unservable_adapter_config_refused(setup, tmp_path, extra, field) -> None:
    llm, requests, _, _ = setup
    rank = extra.get("r", 4)
    write_peft_adapter(tmp_path, SHAPES, 2, targets=("q_proj",), rank=rank, alpha=8, config_extra=extra)
    before = llm.engine.list_loras()
    with pytest.raises(ValueError, match=field):
        llm.generate(
            {"prompt_token_ids": PROMPTS[0]}, PARAMS, use_tqdm=False, lora_request=LoRARequest("bad", 50, str(tmp_path))
        )
    assert llm.engine.list_loras() == before and not llm.engine.has_unfinished_requests()


def test_wrong_base_and_target_refused(setup, tmp_path) -> None:
    llm, _, _, _ = setup
    wide = dict(SHAPES) | {"q_proj": (96, 64)}  # trained on a base with hidden size 96
    write_peft_adapter(tmp_path / "wide", wide, 2, targets=("q_proj",), rank=4, alpha=8)
    with pytest.raises(ValueError, match=r"q_proj\.lora_A has shape \(4, 96\).*wrong base model.*tiny-test-base"):
        llm.engine.add_lora(LoRARequest("wide", 60, str(tmp_path / "wide")))
    head = write_peft_adapter(tmp_path / "head", SHAPES, 2, targets=("q_proj",), rank=4, alpha=8)
    assert head
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "head" / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.zeros(256, 4)
    save_file(tensors, str(tmp_path / "head" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"'target_modules' includes 'lm_head'"):
        llm.engine.add_lora(LoRARequest("head", 61, str(tmp_path / "head")))
    with pytest.raises(ValueError, match="lora_request.lora_int_id"):
        LoRARequest("x", 0, str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        llm.engine.add_lora(LoRARequest("missing", 62, str(tmp_path / "nope")))


def test_lora_off_refuses_lora_request(tiny_checkpoints) -> None:
    llm = LLM(tiny_checkpoints["LlamaForCausalLM"][1], device="cpu", dtype="float32", num_kv_blocks=16)
    assert llm.engine.lora_manager is None and llm.engine.runner.lora_manager is None
    with pytest.raises(ValueError, match="lora_request: .*LoRA is not enabled"):
        llm.generate("hi", SamplingParams(max_tokens=1), use_tqdm=False, lora_request=LoRARequest("a", 1, "/x"))


@pytest.mark.parametrize(
    "variable",
    ["QSERVE_LORA_EXPAND_BLOCK_N", "QSERVE_LORA_SIDE_SPLIT_K", "QSERVE_LORA_OVERLAP", "QSERVE_LORA_FUSED_SILU"],
)
def test_bad_lora_kernel_setting_stops_the_load(tiny_checkpoints, monkeypatch, variable) -> None:
    """A misspelt LoRA kernel setting is refused by name when the engine is built, not at a later step."""
    monkeypatch.setenv(variable, "wide")
    with pytest.raises(ValueError, match=variable):
        LLM(tiny_checkpoints["LlamaForCausalLM"][1], device="cpu", dtype="float32", num_kv_blocks=16, enable_lora=True)


def test_fused_silu_switch_gives_the_same_outputs(setup, monkeypatch) -> None:
    """QSERVE_LORA_FUSED_SILU=1 (read when the model is built): every MLP routes gate_up's adapter through
    ``finish_lora_silu_and_mul``; on CPU that is the reference's expand, then the product: the outputs of
    the engine without it, bit for bit, for a batch of adapters (one of them not on gate_up) and the base."""
    from quant_kernels import lora_ops

    llm, requests, _, root = setup
    monkeypatch.setenv(lora_ops.FUSED_SILU_ENV, "1")
    fused = LLM(str(root / "base"), device="cpu", dtype="float32", skip_tokenizer_init=True, enable_lora=True,
                max_loras=4, max_lora_rank=16, num_kv_blocks=64, max_num_seqs=16)  # fmt: skip
    mlps = [m for m in fused.engine.runner.model.modules() if hasattr(m, "fused_lora_silu")]
    assert mlps and all(m.fused_lora_silu for m in mlps)
    calls = []
    finish = lora_ops.finish_lora_silu_and_mul
    monkeypatch.setattr(lora_ops, "finish_lora_silu_and_mul", lambda *a: calls.append(1) or finish(*a))
    names = ["mlp-r16-rs", "qv-r4", None, "all-r8"]
    loras = [None if n is None else requests[n] for n in names]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[: len(names)]]
    got = fused.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
    want = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
    assert calls, "the fused path was not taken"
    for name, a, b in zip(names, got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and _prompt_lp(a) == _prompt_lp(b), name


def test_rslora_scale() -> None:
    from qserve.lora.peft import check_adapter_config

    assert check_adapter_config({"r": 16, "lora_alpha": 32}, None, 16) == (16, 2.0)
    assert check_adapter_config({"r": 16, "lora_alpha": 32, "use_rslora": True}, None, 16) == (16, 32 / math.sqrt(16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_triton_path_matches_reference_path(setup, monkeypatch) -> None:
    """On CUDA (fp16): the engine with the opt-in Triton kernels (QSERVE_LORA_TRITON=1) gives the
    outputs of the PyTorch reference path, for a batch of five adapters and the base; and with the LoRA
    decode graphs (QSERVE_LORA_GRAPHS=1) the eager engine's tokens."""
    _, requests, _, root = setup
    llm = LLM(
        str(root / "base"), dtype="float16", skip_tokenizer_init=True, enable_lora=True, max_loras=4, num_kv_blocks=64
    )
    names = [*ADAPTERS, None, None]
    loras = [None if n is None else requests[n] for n in names]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("QSERVE_LORA_TRITON", flag)
        runs[flag] = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
    for name, ref, got in zip(names, runs["0"], runs["1"]):
        assert max(abs(a - b) for a, b in zip(_prompt_lp(got), _prompt_lp(ref))) < 2e-2, name
    # QSERVE_LORA_GRAPHS=1: decode graphs that take the adapter slots; decode tokens match the eager run's
    monkeypatch.setenv("QSERVE_LORA_GRAPHS", "1")
    graphed = LLM(str(root / "base"), dtype="float16", skip_tokenizer_init=True, enable_lora=True, max_loras=4,
                  num_kv_blocks=64)  # fmt: skip
    assert graphed.engine.runner.decode_graphs is not None
    decode = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = llm.generate(prompts, decode, use_tqdm=False, lora_request=loras)
    got = graphed.generate(prompts, decode, use_tqdm=False, lora_request=loras)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(want, got))
    assert same >= len(prompts) - 1  # fp16: one near-tie may flip a greedy token


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_overlapped_lora_gives_the_same_outputs(setup, monkeypatch) -> None:
    """QSERVE_LORA_OVERLAP=shrink (the default) | pair: each LoRA layer's shrink (and the expand) on a side
    stream beside the base GEMM, eagerly (prompt steps) and in the decode graphs, for a batch of
    adapters and the base: "shrink" with the side split left to the heuristic makes the same launches in
    another order, so the same tokens and logprobs as without it; "pair" rounds the expand's sum at another
    point (lora_ops' module doc), and "shrink" with QSERVE_LORA_SIDE_SPLIT_K=4 (the default split) sums the shrink's fp32
    partials in other groups (h rounds differently: 1 failed, 30 passed when the bitwise check ran with
    it exported, H100, 2026-12-07), so for those two logprobs within fp16 noise and the same tokens but
    for a near-tie."""
    from quant_kernels import lora_ops

    _, requests, _, root = setup
    names, loras, prompts, params = _every_adapter_and_the_base(requests)
    runs = {}
    for mode, side_split in (("0", "auto"), ("shrink", "auto"), ("pair", "auto"), ("shrink", "4")):
        monkeypatch.setenv(lora_ops.OVERLAP_ENV, mode)
        monkeypatch.setenv(lora_ops.SIDE_SPLIT_K_ENV, side_split)
        llm = LLM(
            str(root / "base"),
            dtype="float16",
            skip_tokenizer_init=True,
            enable_lora=True,
            max_loras=4,
            num_kv_blocks=64,
        )
        overlap = llm.engine.lora_manager.overlap
        assert (overlap is not None) == (mode != "0") and (overlap is None or overlap.pair == (mode == "pair"))
        assert overlap is None or overlap.split_k == (None if side_split == "auto" else int(side_split))
        assert llm.engine.runner.decode_graphs is not None
        assert llm.engine.runner.decode_graphs.lora_overlap is overlap
        key = mode if side_split == "auto" else f"{mode}-split{side_split}"
        runs[key] = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        del llm
    for name, want, got in zip(names, runs["0"], runs["shrink"]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, name
        assert _prompt_lp(got) == _prompt_lp(want), name
        assert got.outputs[0].cumulative_logprob == want.outputs[0].cumulative_logprob, name
    for other in ("pair", "shrink-split4"):
        for name, want, got in zip(names, runs["0"], runs[other]):
            assert max(abs(a - b) for a, b in zip(_prompt_lp(got), _prompt_lp(want))) < 2e-2, (other, name)
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(runs["0"], runs[other]))
        assert same >= len(prompts) - 1, other  # fp16: one near-tie may flip a greedy token


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_silu_gives_the_same_outputs(setup, monkeypatch) -> None:
    """QSERVE_LORA_FUSED_SILU=1 on CUDA (fp16, the Triton kernels, the shrink beside the GEMM, decode graphs):
    gate_up's expand inside the SiLU-and-mul gives the two launches' tokens (but for a near-tie) and
    logprobs within fp16 noise (the expand may fold y into its MMA's accumulator, the fused kernel adds
    it after), for a batch of adapters and the base."""
    from quant_kernels import lora_ops

    _, requests, _, root = setup
    names, loras, prompts, params = _every_adapter_and_the_base(requests)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(lora_ops.FUSED_SILU_ENV, flag)
        llm = LLM(str(root / "base"), dtype="float16", skip_tokenizer_init=True, enable_lora=True, max_loras=4,
                  num_kv_blocks=64)  # fmt: skip
        assert llm.engine.runner.decode_graphs is not None
        runs[flag] = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        del llm
    for name, want, got in zip(names, runs["0"], runs["1"]):
        assert max(abs(a - b) for a, b in zip(_prompt_lp(got), _prompt_lp(want))) < 2e-2, name
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(runs["0"], runs["1"]))
    assert same >= len(prompts) - 1  # fp16: one near-tie may flip a greedy token


def _every_adapter_and_the_base(requests: dict) -> tuple[list, list, list, SamplingParams]:
    """(names, LoRA requests, prompts, decode params) of a batch of every adapter and the base twice."""
    names = [*ADAPTERS, None, None]
    loras = [None if n is None else requests[n] for n in names]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    return names, loras, prompts, params


def test_embed_takes_an_adapter(setup) -> None:
    llm, requests, references, _ = setup
    prompt = {"prompt_token_ids": PROMPTS[0]}
    base, tuned = llm.embed([prompt, prompt], use_tqdm=False, lora_request=[None, requests["all-r8"]])
    with torch.no_grad():  # the merged model's last hidden state, L2-normalized
        hidden = references["all-r8"](torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states[-1][0, -1]
    want = torch.nn.functional.normalize(hidden.double(), dim=0)
    torch.testing.assert_close(torch.tensor(tuned.outputs.embedding, dtype=torch.float64), want, atol=1e-4, rtol=0)
    assert max(abs(a - b) for a, b in zip(base.outputs.embedding, tuned.outputs.embedding)) > 1e-3


def test_decode_graph_inputs_with_adapters(setup, monkeypatch) -> None:
    """The LoRA decode graphs' staging (QSERVE_LORA_GRAPHS=1: each row's slot and the padded tiles as
    static inputs), on CPU with eager replays standing in for the graphs: tokens and logprobs equal the
    eager runner's for a batch of adapters and the base, padded to the next bucket. With
    QSERVE_LORA_STAGE_ON_CHANGE (on unless "0") the buffer is staged when a step's rows change adapters, not at every replay."""
    from qserve.runner import cuda_graphs
    from tests.integration.test_decode_graph_inputs import EagerReplay

    llm, requests, _, _ = setup
    runner = llm.engine.runner
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:5]]
    loras = [requests["all-r8"], None, requests["qv-r4"], requests["all-r8"], requests["mlp-r16-rs"]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    eager = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    monkeypatch.delenv(cuda_graphs.LORA_STAGE_ON_CHANGE_ENV, raising=False)  # on by default
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 8, 256, runner.block_size, runner.device, (1, 2, 8), 4)
    for bucket in graphs.buckets:
        graphs.graphs[bucket] = EagerReplay(lambda b=bucket: graphs.logits[:b].copy_(graphs._run(b)))
    replays = []
    original = graphs.replay
    graphs.replay = lambda *args, **kwargs: replays.append(kwargs["lora_slots"]) or original(*args, **kwargs)
    fills = []  # the buffer's restagings
    fill = cuda_graphs.fill_index_buffer
    monkeypatch.setattr(cuda_graphs, "fill_index_buffer", lambda *args: fills.append(args[1].copy()) or fill(*args))
    runner.decode_graphs = graphs
    try:
        staged = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        # the same rows again, their adapters in another order: restaged, and still the eager tokens
        restaged_from = len(fills)
        swapped = llm.generate(prompts, params, use_tqdm=False, lora_request=loras[::-1])
    finally:
        runner.decode_graphs = None
    assert replays and any(slots is not None and len(slots) == 5 for slots in replays)  # padded 5 -> 8
    # each run's decode rows keep their adapters: staged once per run, not once per replay
    assert len(replays) >= 2 * len(fills) and restaged_from == 1 and len(fills) == 2, (len(replays), fills)
    assert not np.array_equal(fills[0], fills[1])
    eager_swapped = llm.generate(prompts, params, use_tqdm=False, lora_request=loras[::-1])
    for a, b in [*zip(eager, staged), *zip(eager_swapped, swapped)]:
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


def test_moe_model_adapts_attention_and_dense_mlps_only(tmp_path) -> None:
    """A mixture-of-experts base: LoRA slots for every attention block and the dense MLP of Qwen3's
    mlp_only layer, none for routed experts or a shared expert (their blocks take no LoRA)."""
    from qserve.lora.slots import lora_targets
    from qserve.model.loader import load_model
    from tests.helpers.moe_models import moe_oracle, save_moe

    path = save_moe(moe_oracle("Qwen3MoeForCausalLM", seed=3), tmp_path / "moe")
    model, config = load_model(path, torch.float32, "cpu")
    assert sorted(lora_targets(model)) == [
        "model.layers.0.mlp.down_proj",
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.1.self_attn.o_proj",
        "model.layers.1.self_attn.qkv_proj",
    ]
    from qserve.lora.request import LoRAConfig
    from qserve.lora.slots import LoRAManager

    manager = LoRAManager(model, LoRAConfig(max_loras=2, max_lora_rank=8), torch.float32, torch.device("cpu"))
    assert manager.nbytes == lora_slot_bytes(config, 2, 8, torch.float32)


def test_moe_model_generates_with_an_adapter_as_the_merged_reference(tmp_path) -> None:
    """A step with adapter rows on a mixture-of-experts model: every MLP takes the step's LoRA rows
    (the MoE block passed them to no expert; it once refused the argument: TypeError at the first
    adapter step). Greedy tokens and prompt logprobs equal the oracle with the adapter merged."""
    from tests.helpers.moe_models import moe_oracle, save_moe

    oracle = moe_oracle("Qwen3MoeForCausalLM", seed=3).float().eval()
    path = save_moe(oracle, tmp_path / "moe")
    shapes = projection_shapes(64, 96, 4, 2, 16)
    written = write_peft_adapter(tmp_path / "ad", shapes, 2, targets=("q_proj", "v_proj", "o_proj"), rank=4, alpha=8)
    merged = moe_oracle("Qwen3MoeForCausalLM", seed=3).float().eval()
    merged.load_state_dict(merged_state_dict(oracle.state_dict(), written))
    llm = LLM(str(path), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=32)
    prompt = PROMPTS[2]
    out = llm.generate({"prompt_token_ids": prompt}, PARAMS, lora_request=LoRARequest("ad", 1, str(tmp_path / "ad")))
    want_lp, want_tokens = _reference(merged, prompt, PARAMS.max_tokens)
    assert out[0].outputs[0].token_ids == want_tokens
    assert max(abs(a - b) for a, b in zip(_prompt_lp(out[0]), want_lp)) < 2e-4


def test_lora_with_speculative_decoding_is_refused() -> None:
    from qserve.engine.engine import EngineConfig

    with pytest.raises(ValueError, match="enable_lora: .*speculative_config"):
        EngineConfig("m", enable_lora=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
