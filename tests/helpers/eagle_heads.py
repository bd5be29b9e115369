"""Tiny EAGLE / EAGLE-3 head checkpoints for a tiny target, in the layout vLLM loads.

Knows: the tensor names and shapes of ``EagleLlamaForCausalLM`` (``fc [H, 2H]``, ``layers.N.*``) and
``Eagle3LlamaForCausalLM`` (``fc [H, 3H]``, ``midlayer.*`` with a 2H-wide q/k/v and ``hidden_norm``,
``norm``, ``lm_head [draft_vocab, H]``, ``d2t``, ``t2d``) checkpoints, and how to write one with
random or given weights. Also a "permutation" target whose greedy continuation is t -> perm[t],
with heads that predict it from the target's hidden states alone (the acceptance tests). Must not
know: qserve internals.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint


def head_config(target: dict, method: str, **overrides) -> dict:
    """A head config.json: the target's shapes, one layer, vLLM's architecture name."""
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "eos_token_id",
        "torch_dtype",
    )
    config = {k: target[k] for k in keys if k in target}
    config.update(
        architectures=["LlamaForCausalLMEagle3" if method == "eagle3" else "EagleLlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
    )
    config.update(overrides)
    return config


def head_tensors(config: dict, method: str, seed: int = 0, std: float = 0.08) -> dict[str, torch.Tensor]:
    """Random weights for every tensor of the head described by ``config``."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    vocab = config["vocab_size"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm() -> torch.Tensor:
        return 1.0 + torch.randn(hidden, generator=gen) * 0.05

    tensors: dict[str, torch.Tensor] = {}
    layer_in = 2 * hidden if method == "eagle3" else hidden
    for i in range(config["num_hidden_layers"]):
        prefix = "midlayer" if method == "eagle3" and i == 0 else f"layers.{i}"
        width = layer_in if i == 0 else hidden
        tensors.update(
            {
                f"{prefix}.self_attn.q_proj.weight": rand(heads * head_dim, width),
                f"{prefix}.self_attn.k_proj.weight": rand(kv_heads * head_dim, width),
                f"{prefix}.self_attn.v_proj.weight": rand(kv_heads * head_dim, width),
                f"{prefix}.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                f"{prefix}.mlp.gate_proj.weight": rand(inter, hidden),
                f"{prefix}.mlp.up_proj.weight": rand(inter, hidden),
                f"{prefix}.mlp.down_proj.weight": rand(hidden, inter),
                f"{prefix}.post_attention_layernorm.weight": norm(),
            }
        )
        if method == "eagle3" or i > 0:
            tensors[f"{prefix}.input_layernorm.weight"] = norm()
    if method == "eagle3":
        draft_vocab = config.get("draft_vocab_size") or vocab
        tensors["midlayer.hidden_norm.weight"] = norm()
        tensors["fc.weight"] = rand(hidden, 3 * config.get("target_hidden_size", hidden))
        tensors["norm.weight"] = norm()
        tensors["lm_head.weight"] = rand(draft_vocab, hidden)
        # the draft vocabulary: a sorted random subset of the target's ids, as offsets
        chosen = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab]).values
        tensors["d2t"] = chosen - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[chosen] = True
        tensors["t2d"] = t2d
    else:
        tensors["fc.weight"] = rand(hidden, 2 * hidden)
        tensors["embed_tokens.weight"] = rand(vocab, hidden)  # EAGLE saves the target's copy; unused
    return tensors


def save_head(path: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def random_head(path: str | Path, target: dict, method: str, seed: int = 0, **overrides) -> Path:
    config = head_config(target, method, **overrides)
    return save_head(path, config, head_tensors(config, method, seed))


# ----------------------------------------------------------------------------------------------
# A target whose greedy output is a permutation walk, and heads that predict it
# ----------------------------------------------------------------------------------------------

PERM_SLOTS = 64  # tokens of the walk: one hidden dimension each (hidden_size 64)
PERM_FIRST = 100  # their ids: 100..163 (not special tokens)


def permutation(num: int = PERM_SLOTS, seed: int = 3) -> list[int]:
    """A single cycle over ``num`` slots (no fixed point, no short loops)."""
    order = torch.randperm(num, generator=torch.Generator().manual_seed(seed)).tolist()
    perm = [0] * num
    for a, b in zip(order, order[1:] + order[:1]):
        perm[a] = b
    return perm


def walk_tokens(perm: list[int], slot: int, num: int) -> list[int]:
    """The ``num`` tokens the permutation target generates greedily after token ``PERM_FIRST + slot``."""
    tokens = []
    for _ in range(num):
        slot = perm[slot]
        tokens.append(PERM_FIRST + slot)
    return tokens


def permutation_target(path: str | Path, perm: list[int], num_layers: int = 4) -> tuple[Path, dict]:
    """A Llama target whose layers add nothing (o_proj and down_proj are zero): its stream is the
    token's embedding, one-hot in slot s for token PERM_FIRST + s, and its lm_head sends slot s to
    token PERM_FIRST + perm[s]. Greedy: t -> PERM_FIRST + perm[t - PERM_FIRST]."""
    model = make_tiny_model("LlamaForCausalLM", seed=11, num_hidden_layers=num_layers)
    hidden = model.config.hidden_size
    assert hidden == PERM_SLOTS
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, 0] = 0.5  # tokens outside the walk: some direction; never generated
        lm_head = model.lm_head.weight
        lm_head.zero_()
        for s in range(PERM_SLOTS):
            embed[PERM_FIRST + s].zero_()
            embed[PERM_FIRST + s, s] = 1.0
            lm_head[PERM_FIRST + perm[s], s] = 1.0
    save_tiny_checkpoint(model, path)
    return Path(path), model.config.to_dict()


def _advance_mlp(tensors: dict[str, torch.Tensor], prefix: str, perm: list[int], scale: float) -> None:
    """An MLP that maps ``c e_s`` (c = sqrt(hidden), a normed one-hot) to ``scale (e_perm[s] - e_s)``:
    gate picks slot s (silu(0) = 0 elsewhere), up passes it, down permutes."""
    hidden = PERM_SLOTS
    inter = tensors[f"{prefix}.mlp.gate_proj.weight"].shape[0]
    big = 4.0
    gate = torch.zeros(inter, hidden)
    up = torch.zeros(inter, hidden)
    down = torch.zeros(hidden, inter)
    c = hidden**0.5
    for s in range(hidden):
        gate[s, s] = big
        up[s, s] = 1.0
        # silu(big c) * c ~ big c^2 on row s
        down[perm[s], s] += scale / (big * c * c)
        down[s, s] -= scale / (big * c * c)
    tensors[f"{prefix}.mlp.gate_proj.weight"] = gate
    tensors[f"{prefix}.mlp.up_proj.weight"] = up
    tensors[f"{prefix}.mlp.down_proj.weight"] = down


def oracle_head(path: str | Path, target: dict, method: str, perm: list[int], **overrides) -> Path:
    """A head that predicts the permutation target from its hidden states alone: its attention adds
    nothing, fc passes the target's feature of position p (EAGLE: the final normed state, c e_s;
    EAGLE-3: the lowest tap, e_s) and the MLP advances it one step of the walk, so the output is
    the target's feature of position p + 1 and its logits give the token at p + 2. With the
    features of a wrong position, or none, its drafts are wrong."""
    config = head_config(target, method, **overrides)
    tensors = head_tensors(config, method, seed=1)
    hidden = PERM_SLOTS
    prefix = "midlayer" if method == "eagle3" else "layers.0"
    tensors[f"{prefix}.self_attn.o_proj.weight"].zero_()
    tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
    if method == "eagle":
        fc = torch.zeros(hidden, 2 * hidden)
        fc[:, hidden:] = torch.eye(hidden)  # the target's feature, not the embedding
        tensors["fc.weight"] = fc
        _advance_mlp(tensors, prefix, perm, scale=hidden**0.5)  # c e_s -> c e_perm[s]
    else:
        fc = torch.zeros(hidden, 3 * hidden)
        fc[:, :hidden] = torch.eye(hidden)  # the lowest tap: the stream entering that layer, e_s
        tensors["fc.weight"] = fc
        tensors["midlayer.hidden_norm.weight"] = torch.ones(hidden)
        tensors["norm.weight"] = torch.ones(hidden)
        _advance_mlp(tensors, prefix, perm, scale=1.0)  # e_s -> e_perm[s]
        # draft vocabulary: the walk's tokens, listed in reverse so d2t is not a constant offset
        draft_vocab = config["draft_vocab_size"]
        ids = torch.tensor([PERM_FIRST + s for s in reversed(range(PERM_SLOTS))] + list(range(draft_vocab - hidden)))
        tensors["d2t"] = ids - torch.arange(draft_vocab)
        lm_head = torch.zeros(draft_vocab, hidden)
        for d in range(hidden):  # draft id d is token ids[d]; it follows slot s when perm[s] == its slot
            slot = int(ids[d]) - PERM_FIRST
            lm_head[d, perm.index(slot)] = 1.0
        tensors["lm_head.weight"] = lm_head
        t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    return save_head(path, config, tensors)
