"""The CUDA-graph decode path's input staging (padding to a bucket, static buffers, pad rows),
checked on CPU: the graphs are replaced by eager replays of the same static-buffer forward, so
everything but the capture itself runs, and tokens must equal the eager runner's."""

from __future__ import annotations

from qserve import LLM, SamplingParams
from qserve.runner.cuda_graphs import DecodeGraphs


class EagerReplay:
    """Stands in for a captured torch.cuda.CUDAGraph: replay() reruns the captured callable."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def install_fake_graphs(llm: LLM, buckets: tuple[int, ...]) -> DecodeGraphs:
    engine = llm.engine
    runner = engine.runner
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, engine.config.max_num_seqs, engine.max_model_len, runner.block_size,
        runner.device, buckets=buckets,
    )  # fmt: skip
    for bucket in graphs.buckets:
        graphs.graphs[bucket] = EagerReplay(lambda b=bucket: graphs.logits[:b].copy_(graphs._run(b)))
    runner.decode_graphs = graphs
    return graphs


def test_graph_decode_inputs_match_eager(tiny_checkpoints):
    path = tiny_checkpoints["LlamaForCausalLM"][1]
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 33, 2, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    eager = LLM(path, device="cpu", dtype="float32", max_num_seqs=8).generate(prompts, params)

    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=8)
    graphs = install_fake_graphs(llm, buckets=(1, 2, 4, 8))
    replays = []
    original = graphs.replay
    graphs.replay = lambda *args, **kwargs: replays.append(len(args[0])) or original(*args, **kwargs)
    staged = llm.generate(prompts, params)
    assert replays and any(n not in graphs.buckets for n in replays)  # some batches were padded
    for a, b in zip(eager, staged):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token in pa:
                assert abs(pa[token].logprob - pb[token].logprob) < 1e-4
