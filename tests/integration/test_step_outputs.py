"""``Engine.step(finished_only=True)``: the offline path builds only finished outputs, and they are
the same outputs the streaming path (``step()``) ends with."""

from __future__ import annotations

from qserve import LLM, SamplingParams
from qserve.outputs import RequestOutput

PROMPT = {"prompt_token_ids": [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]}
REQUESTS = [
    ("greedy", PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    ("n2", PROMPT, SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=3, max_tokens=9, logprobs=2, ignore_eos=True)),
    ("stop", {"prompt_token_ids": [7, 8, 9]}, SamplingParams(temperature=0, max_tokens=16, stop=["e"])),
    ("plp", {"prompt_token_ids": [60, 61, 62, 63]}, SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1)),
    ("penalty", PROMPT, SamplingParams(temperature=0, max_tokens=7, repetition_penalty=1.3, min_tokens=3)),
    ("abort", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
]


def _run(path: str, finished_only: bool) -> tuple[dict[str, RequestOutput], int]:
    engine = LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=32).engine
    for request_id, prompt, params in REQUESTS:
        engine.add_request(request_id, prompt, params)
    finished: dict[str, RequestOutput] = {}
    num_unfinished_outputs = 0
    num_steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step(finished_only=finished_only)
        num_steps += 1
        if num_steps == 4:
            engine.abort_request("abort")
        for output in outputs:
            if not output.finished:
                num_unfinished_outputs += 1
                continue
            assert output.request_id not in finished
            finished[output.request_id] = output
    return finished, num_unfinished_outputs


def test_finished_only_returns_the_same_final_outputs(tiny_checkpoints):
    path = tiny_checkpoints["LlamaForCausalLM"][1]
    streamed, num_streamed_partials = _run(path, finished_only=False)
    offline, num_offline_partials = _run(path, finished_only=True)
    assert num_streamed_partials > 0 and num_offline_partials == 0
    assert sorted(offline) == sorted(streamed) == sorted(r[0] for r in REQUESTS)
    assert offline == streamed
    assert offline["abort"].outputs[0].finish_reason == "abort"
    assert offline["stop"].outputs[0].finish_reason in ("stop", "length")
    assert len(offline["n2"].outputs) == 2 and all(len(c.logprobs) == 9 for c in offline["n2"].outputs)
    assert len(offline["plp"].prompt_logprobs) == 4


def test_generate_asks_only_for_finished_outputs(llama_llm):
    engine = llama_llm.engine
    seen: list[bool] = []
    original = engine.step

    def spy(*, finished_only: bool = False):
        seen.append(finished_only)
        return original(finished_only=finished_only)

    engine.step = spy
    try:
        outputs = llama_llm.generate([PROMPT, PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    finally:
        del engine.step
    assert seen and all(seen)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5]
