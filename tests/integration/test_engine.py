"""End-to-end engine behaviour on CPU: batching, chunked prefill, preemption, prefix caching,
seeded sampling, stops, detokenization and bad input."""

from __future__ import annotations

import random

import pytest

from qserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def mixed_prompts(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 390) for _ in range(rng.randint(1, 70))]} for _ in range(count)]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoints) -> str:
    return tiny_checkpoints["LlamaForCausalLM"][1]


@pytest.fixture(scope="module")
def alone(llama_path) -> list[list[int]]:
    """Greedy tokens of each prompt run by itself."""
    llm = LLM(llama_path, device="cpu", dtype="float32", enable_prefix_caching=False)
    return [tokens(llm.generate([p], GREEDY))[0] for p in mixed_prompts(32)]


def test_batch_invariance(llama_path, alone):
    llm = LLM(llama_path, device="cpu", dtype="float32")
    assert tokens(llm.generate(mixed_prompts(32), GREEDY)) == alone


def test_batch_invariance_with_chunked_prefill(llama_path, alone):
    llm = LLM(llama_path, device="cpu", dtype="float32", max_num_batched_tokens=24)
    assert tokens(llm.generate(mixed_prompts(32), GREEDY)) == alone
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


def test_preemption_keeps_outputs_and_frees_every_block(llama_path, alone):
    # 12 blocks of 16 tokens cannot hold 32 sequences of up to 80 tokens: the scheduler must
    # preempt (recompute) and still produce the same tokens.
    llm = LLM(llama_path, device="cpu", dtype="float32", num_kv_blocks=12, enable_prefix_caching=False)
    # No admission watermark: this test is about the preemption path itself.
    llm.engine.scheduler.watermark, llm.engine.scheduler.watermark_per_running = 0.0, 0
    preemptions = []
    original_schedule = llm.engine.scheduler.schedule

    def spy():
        out = original_schedule()
        preemptions.extend(out.preempted_request_ids)
        return out

    llm.engine.scheduler.schedule = spy
    assert tokens(llm.generate(mixed_prompts(32), GREEDY)) == alone
    assert preemptions, "the pool was large enough that nothing was preempted"
    assert llm.engine.block_pool.num_free_blocks == 12


def test_prefix_caching_shares_pages_and_skips_compute(llama_path):
    llm = LLM(llama_path, device="cpu", dtype="float32")
    shared = list(range(10, 58))  # 48 tokens = 3 full blocks
    first = llm.generate([{"prompt_token_ids": shared + [100, 101]}], GREEDY)[0]
    second = llm.generate([{"prompt_token_ids": shared + [102, 103]}], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48
    cold = LLM(llama_path, device="cpu", dtype="float32", enable_prefix_caching=False)
    assert (
        second.outputs[0].token_ids
        == cold.generate([{"prompt_token_ids": shared + [102, 103]}], GREEDY)[0].outputs[0].token_ids
    )


def test_seeded_sampling_is_reproducible_across_batches(llama_llm):
    target = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llama_llm.generate([target], params)[0].outputs[0].token_ids
    others = mixed_prompts(7, seed=3)
    other_params = [SamplingParams(temperature=0.8, max_tokens=15, ignore_eos=True, seed=i) for i in range(4)] + [
        SamplingParams(temperature=1.2, max_tokens=9, ignore_eos=True)
    ] * 3
    batch = llama_llm.generate(others[:3] + [target] + others[3:], other_params[:3] + [params] + other_params[3:])
    assert batch[3].outputs[0].token_ids == alone


def test_top_k_one_equals_greedy(llama_llm):
    prompts = mixed_prompts(4, seed=9)
    greedy = tokens(llama_llm.generate(prompts, GREEDY))
    top1 = tokens(llama_llm.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True)))
    assert top1 == greedy


def test_n_sequences_and_logprobs(llama_llm):
    out = llama_llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}],
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True, logprobs=2),
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for completion in out.outputs:
        assert len(completion.token_ids) == 4 and len(completion.logprobs) == 4
        for token, position in zip(completion.token_ids, completion.logprobs):
            assert token in position and 2 <= len(position) <= 3
        assert completion.cumulative_logprob == pytest.approx(
            sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs))
        )


def test_stop_strings_are_excluded_even_across_tokens(llama_llm):
    prompt = {"prompt_token_ids": [40, 41, 42]}
    free = llama_llm.generate([prompt], GREEDY)[0].outputs[0]
    assert len(free.text) >= 4
    stop = free.text[2:4]  # likely spans a token boundary
    stopped = llama_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop]))[
        0
    ]
    completion = stopped.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == free.text[: free.text.index(stop)]


def test_stop_token_ids_and_max_tokens(llama_llm):
    prompt = {"prompt_token_ids": [40, 41, 42]}
    free = llama_llm.generate([prompt], GREEDY)[0].outputs[0]
    stop_id = free.token_ids[3]
    out = llama_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id])
    )[0]
    first = free.token_ids.index(stop_id)
    assert out.outputs[0].token_ids == free.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_utf8_text_matches_full_decode(llama_llm):
    tokenizer = llama_llm.get_tokenizer()
    out = llama_llm.generate(
        ["Grüße 中文 😀"], SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    )[0]
    completion = out.outputs[0]
    decoded = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    # A random model may end on half a character: it is held back, never shown broken.
    assert decoded.startswith(completion.text)
    assert set(decoded[len(completion.text) :]) <= {"\ufffd"}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"bogus_field": 1}, "bogus_field"),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_raise_and_the_engine_keeps_serving(llama_path):
    llm = LLM(llama_path, device="cpu", dtype="float32", max_model_len=64)
    engine = llm.engine
    engine.add_request(
        "good", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    engine.step()
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("too-long", {"prompt_token_ids": [3] * 100}, GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("bad-token", {"prompt_token_ids": [10**6]}, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", {"prompt_token_ids": []}, GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [3] * 100}], GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"] and len(finished[0].outputs[0].token_ids) == 5


def test_abort_frees_pages_the_same_step(llama_path):
    llm = LLM(llama_path, device="cpu", dtype="float32")
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": list(range(3, 60))}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.block_pool.num_free_blocks < engine.block_pool.num_blocks
    engine.abort_request("a")
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    (output,) = engine.step()
    assert output.finished and output.outputs[0].finish_reason == "abort"


def test_unsupported_architecture_is_named(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        LLM(str(tmp_path), device="cpu")


def test_preempted_requests_report_prompt_logprobs_once(llama_path):
    prompts = mixed_prompts(12, seed=5)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    roomy = LLM(llama_path, device="cpu", dtype="float32").generate(prompts, params)
    tight_llm = LLM(llama_path, device="cpu", dtype="float32", num_kv_blocks=8)
    tight = tight_llm.generate(prompts, params)
    for prompt, a, b in zip(prompts, roomy, tight):
        assert len(b.prompt_logprobs) == len(prompt["prompt_token_ids"])
        assert [p and sorted(p) for p in a.prompt_logprobs] == [p and sorted(p) for p in b.prompt_logprobs]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert tight_llm.engine.block_pool.num_free_blocks == 8


def test_sequence_outgrowing_the_pool_finishes_with_length(llama_path):
    # 2 blocks = 32 tokens of KV in all: the sequence cannot grow past it and must not hang.
    llm = LLM(llama_path, device="cpu", dtype="float32", num_kv_blocks=2, max_model_len=100)
    out = llm.generate([{"prompt_token_ids": list(range(3, 23))}], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert 0 < len(out.outputs[0].token_ids) < 50


def test_a_refused_request_id_leaves_nothing_running(llama_path):
    """`n > 1` sequences are named `<id>#<i>`: a clash with an existing request must refuse the
    whole request up front, not after queuing some of its sequences."""
    llm = LLM(llama_path, device="cpu", dtype="float32")
    engine = llm.engine
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("a#1", {"prompt_token_ids": [3, 4]}, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", {"prompt_token_ids": [3, 4]}, params.clone(n=2))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["a#1"]
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_a_prompt_the_pool_can_never_hold_is_refused_before_queuing(llama_path):
    llm = LLM(llama_path, device="cpu", dtype="float32", num_kv_blocks=2, max_model_len=100)
    with pytest.raises(ValueError, match="can never fit in the KV cache"):
        llm.engine.validate_request({"prompt_token_ids": [3] * 40}, SamplingParams())
