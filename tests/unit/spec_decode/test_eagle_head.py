"""EAGLE / EAGLE-3 heads: reading vLLM's config keys, loading vLLM's tensor names (a missing, unknown,
misshapen or out-of-range tensor is refused naming it), and the target's hidden states the runner
hands over (the final ones; EAGLE-3's taps are the streams entering the tapped layers, checked
against transformers' ``output_hidden_states``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qserve.model.loader import load_model
from qserve.runner.model_runner import ModelRunner, allocate_kv_caches
from qserve.sampling_params import SamplingParams
from qserve.scheduler.output import ScheduledSequence, SchedulerOutput
from qserve.spec_decode.eagle_config import default_aux_layer_ids, eagle_config_from_dict, read_eagle_config
from qserve.spec_decode.eagle_head import eagle_head_bytes, load_eagle_head
from tests.helpers.eagle_heads import head_config, head_tensors, save_head
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):  # noqa: ANN201
    """(transformers model, qserve model, qserve config, HF config dict) of a 4-layer tiny Llama."""
    hf = make_tiny_model("LlamaForCausalLM", seed=4, num_hidden_layers=4)
    path = save_tiny_checkpoint(hf, tmp_path_factory.mktemp("target"))
    model, config = load_model(path, torch.float32, "cpu")
    return hf, model, config, json.loads((Path(path) / "config.json").read_text())


def _load(tmp_path: Path, target, method: str, config: dict, tensors: dict):  # noqa: ANN001, ANN202
    path = save_head(tmp_path / method, config, tensors)
    head_config_ = read_eagle_config(path, method, target[2])
    return load_eagle_head(path, head_config_, target[1], torch.float32, torch.device("cpu"), 512)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_head_in_vllms_layout_loads(tmp_path, target, method):
    overrides = {"draft_vocab_size": 100} if method == "eagle3" else {}
    config = head_config(target[3], method, **overrides)
    tensors = head_tensors(config, method, seed=7)
    head = _load(tmp_path, target, method, config, tensors)
    if method == "eagle3":
        assert head.config.aux_layer_ids == (2, 2, 1) == default_aux_layer_ids(4)  # vLLM's default for 4 layers
        assert torch.equal(head.d2t, tensors["d2t"])
        assert torch.equal(head.layers[0].hidden_norm.weight, tensors["midlayer.hidden_norm.weight"])  # midlayer.*
        assert head.layers[0].self_attn.qkv_proj.in_features == 2 * 64
        assert head.embed_tokens is None  # the target's is borrowed
    else:
        assert head.config.taps == ()
        q, k = tensors["layers.0.self_attn.q_proj.weight"], tensors["layers.0.self_attn.k_proj.weight"]
        assert torch.equal(head.layers[0].self_attn.qkv_proj.weight[: len(q) + len(k)], torch.cat([q, k]))
        assert not any(p is target[1].model.embed_tokens.weight for p in head.parameters())
    assert eagle_head_bytes(tmp_path / method, method, torch.float32) == sum(
        v.numel() * (8 if k == "d2t" else 4)
        for k, v in tensors.items()
        if k not in ("t2d", "embed_tokens.weight", "lm_head.weight") or (method == "eagle3" and k == "lm_head.weight")
    )


@pytest.mark.parametrize(
    ("method", "change", "message"),
    [
        ("eagle", lambda t: t.pop("fc.weight"), r"missing tensors: fc\.weight"),
        ("eagle", lambda t: t.pop("layers.0.self_attn.k_proj.weight"), r"layers\.0\.self_attn\.k_proj\.weight"),
        ("eagle", lambda t: t.__setitem__("fc.weight", torch.zeros(64, 192)), r"'fc\.weight' has shape \(64, 192\)"),
        (
            "eagle",
            lambda t: t.__setitem__("layers.0.mlp.extra.weight", torch.zeros(2)),
            r"'layers\.0\.mlp\.extra\.weight'",
        ),
        ("eagle3", lambda t: t.pop("d2t"), r"tensor 'd2t' is missing"),
        ("eagle3", lambda t: t.__setitem__("d2t", torch.full((100,), 400)), r"'d2t' maps draft ids outside"),
        ("eagle3", lambda t: t.__setitem__("d2t", torch.zeros(100)), r"'d2t' must hold integer offsets"),
        ("eagle3", lambda t: t.pop("midlayer.hidden_norm.weight"), r"layers\.0\.hidden_norm\.weight"),
        ("eagle3", lambda t: t.pop("lm_head.weight"), r"lm_head\.weight"),
    ],
)
def test_bad_tensors_are_refused_by_name(tmp_path, target, method, change, message):
    config = head_config(target[3], method, **({"draft_vocab_size": 100} if method == "eagle3" else {}))
    tensors = head_tensors(config, method)
    change(tensors)
    with pytest.raises(ValueError, match=message):
        _load(tmp_path, target, method, config, tensors)


@pytest.mark.parametrize(
    ("method", "overrides", "message"),
    [
        ("eagle3", {"architectures": ["EagleLlamaForCausalLM"]}, r"architectures \['EagleLlamaForCausalLM'\].*eagle3"),
        ("eagle", {"architectures": ["Eagle3Speculator"]}, r"speculators-format"),
        ("eagle", {"hidden_size": 32}, r"hidden_size=32 differs from the target's 64"),
        ("eagle3", {"vocab_size": 300}, r"vocab_size=300 differs"),
        ("eagle3", {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, r"eagle_aux_hidden_state_layer_ids \[1, 2, 4\]"),
        ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, r"must be 3 layer ids"),
        ("eagle3", {"draft_vocab_size": 401}, r"draft_vocab_size=401"),
        ("eagle3", {"target_hidden_size": 128}, r"target_hidden_size=128"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(target, method, overrides, message):
    with pytest.raises(ValueError, match=message):
        eagle_config_from_dict(head_config(target[3], method, **overrides), method, target[2], "head/config.json")


def test_eagle3_taps_from_the_config_and_the_two_layer_default(target):
    cfg = head_config(target[3], "eagle3", eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 1]})
    assert eagle_config_from_dict(cfg, "eagle3", target[2], "c").aux_layer_ids == (0, 3, 1)
    no_aux = head_config(target[3], "eagle3", eagle_config={"use_aux_hidden_state": False})
    assert eagle_config_from_dict(no_aux, "eagle3", target[2], "c").taps == ()
    assert default_aux_layer_ids(32) == (2, 16, 29)  # Llama-3-8B: vLLM's taps
    two_layers = json.loads(json.dumps(target[3]))
    two_layers["num_hidden_layers"] = 2
    from qserve.config import ModelConfig

    small = ModelConfig.from_hf(two_layers)
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \(vLLM's default\) \[2, 1, -1\]"):
        eagle_config_from_dict(head_config(two_layers, "eagle3"), "eagle3", small, "c")


@pytest.mark.parametrize("taps", [(), (0, 2, 3), (3, 1)])
def test_the_runner_returns_the_targets_hidden_states(target, taps):
    """Every token's final hidden state (EAGLE), or the streams entering the tapped layers
    (EAGLE-3: transformers' hidden_states[i] is the input of layer i), concatenated in tap order."""
    hf, model, config, _ = target
    runner = ModelRunner(model, config, allocate_kv_caches(config, 8, 4, torch.float32, "cpu"), 4, torch.device("cpu"))
    runner.enable_spec_hidden_states(taps)
    prompt = [5, 9, 31, 7, 44, 2, 18]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    sequence = ScheduledSequence("a", 0, len(prompt), [0, 1], prompt, [], params, True)
    plain = runner.execute(SchedulerOutput([sequence], len(prompt)))
    assert plain.spec_hidden_states is None  # only steps that ask for them
    output = runner.execute(SchedulerOutput([sequence], len(prompt), spec_hidden_states=True))
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = states[-1][0] if not taps else torch.cat([states[i][0] for i in taps], dim=-1)
    torch.testing.assert_close(output.spec_hidden_states, want, atol=2e-5, rtol=1e-4)
    assert output.sampled_token_ids == plain.sampled_token_ids
    with pytest.raises(ValueError, match="outside the model's 4 layers"):
        runner.enable_spec_hidden_states((4,))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_stay_within_the_tokenizers_ids(tmp_path, target, method):
    """Model rows past the tokenizer (a padded vocabulary) are never drafted; EAGLE-3's draft ids
    come back as target ids through d2t."""
    config = head_config(target[3], method, **({"draft_vocab_size": 100} if method == "eagle3" else {}))
    tensors = head_tensors(config, method, seed=5)
    head = _load(tmp_path, target, method, config, tensors)
    rows = torch.randn(256, 64) * 3
    free = head.draft_tokens(rows)
    if method == "eagle3":
        allowed = torch.arange(100) + tensors["d2t"]
        assert bool(torch.isin(free, allowed).all())
        logits = rows @ tensors["lm_head.weight"].T
        assert torch.equal(free, allowed[logits.argmax(-1)])
    assert bool((free >= 200).any()), "without a limit some drafts are high ids"
    head.set_valid_vocab_size(200)
    limited = head.draft_tokens(rows)
    assert bool((limited < 200).all()) and torch.equal(limited[free < 200], free[free < 200])
