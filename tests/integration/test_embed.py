"""Embedding (pooling) requests through the engine: the last prompt token's final hidden state,
L2-normalized, equal to a transformers forward; batched with generation through the same
scheduler and page pool, every page freed at the end."""

from __future__ import annotations

import random

import pytest
import torch

from qserve import LLM, PoolingParams, SamplingParams
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = make_tiny_model("LlamaForCausalLM", seed=3)
    path = str(save_tiny_checkpoint(model, tmp_path_factory.mktemp("embed")))
    # max_num_batched_tokens=24: prompts past 24 tokens are prefilled in chunks
    return model, LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=24, enable_prefix_caching=False)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 390) for _ in range(rng.randint(1, 60))] for _ in range(count)]


def reference(model, token_ids: list[int], normalize: bool = True) -> torch.Tensor:
    """transformers: the final hidden state (after the last norm) of the last token."""
    with torch.no_grad():
        hidden = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    return torch.nn.functional.normalize(hidden, dim=0) if normalize else hidden


def test_embed_matches_transformers_with_chunked_prefill(tiny):
    model, llm = tiny
    batch = prompts(12)
    outputs = llm.embed(batch, use_tqdm=False)
    for token_ids, output in zip(batch, outputs):
        vector = torch.tensor(output.outputs.embedding)
        assert output.prompt_token_ids == token_ids and output.finished
        assert vector.shape == (model.config.hidden_size,)
        torch.testing.assert_close(vector, reference(model, token_ids), atol=1e-5, rtol=1e-5)
        assert abs(vector.norm().item() - 1.0) < 1e-5
    raw = llm.embed(batch[:2], PoolingParams(normalize=False), use_tqdm=False)
    torch.testing.assert_close(torch.tensor(raw[1].outputs.embedding), reference(model, batch[1], normalize=False))
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


def test_embeddings_batch_with_generation_and_free_their_pages(tiny):
    model, llm = tiny
    gen_prompts, embed_prompts = prompts(4, seed=1), prompts(6, seed=2)
    alone = [o.outputs[0].token_ids for o in llm.generate(gen_prompts, GREEDY, use_tqdm=False)]
    engine = llm.engine
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"gen-{i}", p, GREEDY)
    for i, p in enumerate(embed_prompts):
        engine.add_request(f"emb-{i}", p, PoolingParams())
    mixed_steps = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        kinds = {seq.pooling for seq in out.sequences}
        mixed_steps.append(kinds == {True, False})
        return out

    engine.scheduler.schedule = spy
    finished = {}
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
    finally:
        del engine.scheduler.schedule
    assert any(mixed_steps)  # embeddings and generation share steps
    assert [finished[f"gen-{i}"].outputs[0].token_ids for i in range(4)] == alone
    for i, p in enumerate(embed_prompts):
        output = finished[f"emb-{i}"]
        assert output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "stop"
        torch.testing.assert_close(torch.tensor(output.embedding), reference(model, p), atol=1e-5, rtol=1e-5)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_dimensions_other_than_hidden_size_are_refused(tiny):
    model, llm = tiny
    with pytest.raises(ValueError, match="not a Matryoshka"):
        llm.embed([[5, 6]], PoolingParams(dimensions=8), use_tqdm=False)
    same = llm.embed([[5, 6]], PoolingParams(dimensions=model.config.hidden_size), use_tqdm=False)
    assert len(same[0].outputs.embedding) == model.config.hidden_size
    assert not llm.engine.has_unfinished_requests()
