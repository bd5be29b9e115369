"""The engine core's two halves without processes or sockets (issue 27): ``CoreEngine`` (token
ids out) and the front end's ``OutputProcessor`` (text, stop strings, logprob tokens) together
give exactly ``Engine``'s outputs, stop strings the core cannot see included (one sequence of
n stopping while the others go on); the messages carry every params field; the core's loop
hands tenant weights to every scheduler."""

from __future__ import annotations

import os
import re
import time

import pytest
import zmq

from qserve.engine.async_engine import ModelSpec, build_engines
from qserve.engine.core.core import ClientAddresses, ClientChannel, CoreConfig, EngineCore
from qserve.engine.core.core_engine import CoreEngine
from qserve.engine.core.messages import (
    Abort,
    Added,
    AddRequests,
    Codec,
    CoreRequest,
    Outputs,
    SetTenants,
    params_fields,
    request_params,
)
from qserve.engine.core.output_processor import OutputProcessor
from qserve.sampling_params import SamplingParams
from qserve.structured.params import StructuredOutputsParams
from tests.server.conftest import host_config

PROMPT = [5, 17, 9, 30, 2]


@pytest.fixture(scope="module")
def engines(checkpoints):
    specs = [ModelSpec("llama", checkpoints["llama"])]
    return build_engines(specs, host_config())["llama"], build_engines(specs, host_config(), engine_cls=CoreEngine)[
        "llama"
    ]


def _in_process(engine, request_id, params):
    engine.add_request(request_id, list(PROMPT), params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output
    return final


def _split(core, request_id, params):
    processor = OutputProcessor(core.tokenizer, core.eos_token_ids, core.max_model_len)
    processor.add(request_id, None, list(PROMPT), params)
    core.add_request(request_id, list(PROMPT), params)
    final = None
    codec = Codec()
    while core.has_unfinished_requests():
        for sent in core.step():
            delta = codec.decode_core(codec.encode(_wrap(sent))).models[0].outputs[0]  # through msgpack
            processed = processor.process(delta)
            for rid, index in processed.aborts:  # what the client sends back
                core.abort_request(rid) if index is None else core.finish_sequence(rid, index)
            if processed.output is not None and processed.output.finished:
                final = processed.output
    assert len(processor) == 0
    return final


def _wrap(delta):
    from qserve.engine.core.messages import ModelOutputs

    return Outputs([ModelOutputs("llama", [delta])])


def test_outputs_equal_the_engines_including_stop_strings_the_core_cannot_see(engines):
    engine, core = engines
    greedy = _in_process(engine, "g", SamplingParams(max_tokens=40, temperature=0)).outputs[0]
    text = greedy.text
    cases = [
        SamplingParams(max_tokens=40, temperature=0),
        SamplingParams(max_tokens=40, temperature=0, stop=[text[10:13]], logprobs=2, prompt_logprobs=1),
        SamplingParams(max_tokens=40, temperature=0, stop=[text[10:13]], include_stop_str_in_output=True),
        SamplingParams(max_tokens=40, temperature=0, stop=[text[1:3]], min_tokens=6),
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[greedy.token_ids[7]]),
        # n=3 sampled: a frequent character stops some sequences while the others go on
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=3, stop=["e", "a"], logprobs=1),
        SamplingParams(max_tokens=12, temperature=0, skip_special_tokens=False),
        SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
    ]
    stopped_early = 0
    for i, params in enumerate(cases):
        expected = _in_process(engine, f"r{i}", params)
        got = _split(core, f"r{i}", params)
        assert got == expected, (params, got, expected)
        stopped_early += sum(isinstance(c.stop_reason, str) for c in got.outputs)
        assert got.metrics["arrival_time"] <= got.metrics["first_scheduled_time"]
    assert stopped_early >= 4  # the stop-string cases really ended on a stop string
    assert core.block_pool.num_used_by(core.owner) == 0  # every page came back, early stops included


def test_messages_carry_every_params_field():
    params = SamplingParams(
        n=2, temperature=0.5, top_k=3, seed=1, stop=["x"], stop_token_ids=[4], logprobs=1, logit_bias={7: -1.5},
        structured_outputs=StructuredOutputsParams(json={"type": "object"}),
    )  # fmt: skip
    codec = Codec()
    message = codec.decode_frontend(codec.encode(AddRequests(1, "m", [CoreRequest("a", [1], params_fields(params))])))
    assert request_params(message.requests[0]) == params


def test_the_core_loop_sets_tenants_refuses_bad_requests_and_compiles_grammars_off_its_loop(engines, checkpoints):
    _, core_engine = engines
    context = zmq.Context()
    inbound, outbound, reader = context.socket(zmq.PULL), context.socket(zmq.PUSH), context.socket(zmq.PULL)
    reader.bind("inproc://out")
    outbound.connect("inproc://out")
    addresses = ClientAddresses("inproc://in", "inproc://out")
    config = CoreConfig([ModelSpec("llama", checkpoints["llama"])], host_config(), [addresses])
    try:
        loop = EngineCore({"llama": core_engine}, config, [ClientChannel(0, inbound, outbound)])
        loop._handle(SetTenants({"a": 2.0, "b": 1.0}, {"a": 1, "b": None}))  # noqa: SLF001
        assert core_engine.scheduler.tenant_weights == {"a": 2.0, "b": 1.0}
        assert core_engine.scheduler.tenant_max_running == {"a": 1}
        bad = SamplingParams(max_tokens=4, logprobs=10**7)
        loop._handle(AddRequests(5, "llama", [CoreRequest("x", [1, 2], params_fields(bad))]))  # noqa: SLF001
        answer = Codec().decode_core(reader.recv())
        assert answer.submit_id == 5 and answer.error == "value" and "logprobs" in answer.message
        assert not core_engine.has_unfinished_requests()
        # A constraint the core has not compiled: compiled off the loop, then queued; one aborted
        # meanwhile is dropped as soon as it lands.
        choice = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))
        for submit_id, request_id in ((6, "kept"), (7, "aborted")):
            request = CoreRequest(request_id, [1, 2], params_fields(choice))
            loop._handle(AddRequests(submit_id, "llama", [request]))  # noqa: SLF001
        assert len(loop._compiling) == 2  # noqa: SLF001 - not queued yet: their grammar compiles
        loop._handle(Abort("llama", "aborted"))  # noqa: SLF001
        answers = []
        while len(answers) < 2:
            loop._admit_compiled()  # noqa: SLF001 - what each round of the loop does
            while reader.poll(10):
                answers.append(Codec().decode_core(reader.recv()))
        assert sorted((a.submit_id, a.error) for a in answers) == [(6, None), (7, None)]
        # the engines know a request under its front end's index (unique across front ends)
        aborted = next(o for o in core_engine.step() if o.request_id == "0/aborted")
        assert aborted.finished and aborted.sequences[0].finish_reason == "abort" and not aborted.sequences[0].token_ids
        assert list(core_engine._groups) == ["0/kept"]  # noqa: SLF001
        core_engine.abort_request("0/kept")
        core_engine.step()
        assert not core_engine.has_unfinished_requests()
        # A front end that is gone (its process died: this one was re-parented) ends the loop at
        # once, and with it the process and every page it held.
        loop.parent = -1
        started = time.monotonic()
        loop.run()
        assert time.monotonic() - started < 1 and not reader.poll(0)  # no Bye: nobody to say it to
    finally:
        core_engine.scheduler.set_tenants({}, {})
        for sock in (inbound, outbound, reader):
            sock.close(linger=0)
        context.term()


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--api-server-count", "2"], "0", "$QSERVE_ENABLE_MULTIPROCESSING=0 asks for one process"),
        (["--api-server-count", "0"], "0", "must be >= 1"),
        (["--tensor-parallel-size", "2"], "1", "--tensor-parallel-size 2 is not supported yet"),
        (["--api-server-count", "2", "--tensor-parallel-size", "2"], "", "--tensor-parallel-size 2 is not supported"),
        (
            ["--api-server-count", "2", "--tenants", "t.json"],
            "",
            "--tenants is not supported with --api-server-count 2",
        ),
        ([], "maybe", "QSERVE_ENABLE_MULTIPROCESSING='maybe'"),
    ],
)
def test_serve_refuses_what_the_separate_core_does_not_support(checkpoints, monkeypatch, argv, env, message):
    from qserve.commands.serve import build_host_factory
    from tests.server.test_serve_command import serve_args

    monkeypatch.setenv("QSERVE_ENABLE_MULTIPROCESSING", env)
    with pytest.raises(ValueError, match=re.escape(message)):
        build_host_factory(serve_args(checkpoints["llama"], "--device", "cpu", *argv))


def test_several_api_servers_imply_the_core_process(checkpoints, monkeypatch):
    """As in vLLM, N > 1 API servers share one engine core: no switch needed (an unset one is fine)."""
    from qserve.commands.serve import plan_host
    from tests.server.test_serve_command import serve_args

    monkeypatch.delenv("QSERVE_ENABLE_MULTIPROCESSING", raising=False)
    plan = plan_host(serve_args(checkpoints["llama"], "--device", "cpu", "--api-server-count", "3"))
    assert plan.separate_core and plan.api_server_count == 3
    assert not plan_host(serve_args(checkpoints["llama"], "--device", "cpu")).separate_core  # the default: 1


def test_lora_is_planned_for_the_core_process(checkpoints, monkeypatch, tmp_path):
    """--enable-lora with the engine core in its own process (it was refused): the --lora-modules
    adapters become the LoRARequests the core loads at start-up, each naming its base model."""
    from qserve.commands.serve import plan_host
    from qserve.commands.serve_host import plan_lora_requests
    from qserve.lora.request import LoRARequest
    from tests.helpers.lora_adapters import projection_shapes, write_peft_adapter
    from tests.server.test_serve_command import serve_args

    write_peft_adapter(tmp_path / "sql", projection_shapes(64, 128, 4, 2, 16), 2, targets=("q_proj",), rank=4, alpha=8)
    monkeypatch.setenv("QSERVE_ENABLE_MULTIPROCESSING", "1")
    argv = ["--device", "cpu", "--enable-lora", "--lora-modules", f"sql={tmp_path / 'sql'}"]
    plan = plan_host(serve_args(f"base={checkpoints['llama']}", *argv))
    assert plan.separate_core
    assert plan_lora_requests(plan) == [LoRARequest("sql", 1, str(tmp_path / "sql"), "base")]


def test_the_core_serves_several_front_ends_and_drops_one_that_is_gone(engines, checkpoints):
    """Two front ends send a request under the same id: two requests, each one's outputs (under the
    id it sent) to its own front end, the step tokens to one only, the live numbers to both. A front
    end whose liveness pipe closes loses its request (pages freed at once); the other's runs on; the
    last one gone ends the loop."""
    _, core_engine = engines
    context = zmq.Context()
    channels, senders, readers, pipes = [], [], [], []
    for i in range(2):
        inbound, sender, reader, outbound = (context.socket(t) for t in (zmq.PULL, zmq.PUSH, zmq.PULL, zmq.PUSH))
        inbound.bind(f"inproc://in{i}")
        sender.connect(f"inproc://in{i}")
        reader.bind(f"inproc://out{i}")
        outbound.connect(f"inproc://out{i}")
        read_end, write_end = os.pipe()
        channels.append(ClientChannel(i, inbound, outbound, read_end))
        senders.append(sender)
        readers.append(reader)
        pipes.append(write_end)
    addresses = [ClientAddresses(f"inproc://in{i}", f"inproc://out{i}") for i in range(2)]
    config = CoreConfig([ModelSpec("llama", checkpoints["llama"])], host_config(), addresses)
    codec = Codec()

    def received(i: int) -> list:
        messages = []
        while readers[i].poll(20):
            messages.append(codec.decode_core(readers[i].recv()))
        return messages

    def deltas(messages: list) -> list:
        return [d for m in messages if isinstance(m, Outputs) for mo in m.models for d in mo.outputs]

    try:
        loop = EngineCore({"llama": core_engine}, config, channels)
        params = params_fields(SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        for i, sender in enumerate(senders):
            sender.send(codec.encode(AddRequests(10 + i, "llama", [CoreRequest("same", list(PROMPT), params)])))
        loop._receive(0.2)  # noqa: SLF001
        loop._receive(0.0)  # noqa: SLF001
        assert sorted(core_engine._groups) == ["0/same", "1/same"]  # noqa: SLF001
        hosted = loop.models["llama"]
        for _ in range(3):
            loop._step(hosted)  # noqa: SLF001
        first, second = received(0), received(1)
        assert [m.submit_id for m in first if isinstance(m, Added)] == [10]
        assert [m.submit_id for m in second if isinstance(m, Added)] == [11]
        assert {d.request_id for d in deltas(first)} == {d.request_id for d in deltas(second)} == {"same"}
        step_tokens = [
            sum((mo.step_tokens for m in ms if isinstance(m, Outputs) for mo in m.models), []) for ms in (first, second)
        ]
        assert step_tokens[0] and not step_tokens[1]  # each step counted once
        assert any(isinstance(m, Outputs) and m.stats for m in second)  # the numbers reach both
        used = core_engine.block_pool.num_used_by(core_engine.owner)
        os.close(pipes[0])  # front end 0 is gone
        loop._receive(0.2)  # noqa: SLF001
        assert channels[0].gone and hosted.active == {"1/same"}
        assert core_engine.block_pool.num_used_by(core_engine.owner) < used  # its pages, at once
        loop._step(hosted)  # noqa: SLF001
        later = received(1)
        assert {d.request_id for d in deltas(later)} == {"same"} and not any(d.finished for d in deltas(later))
        step_tokens = sum((mo.step_tokens for m in later if isinstance(m, Outputs) for mo in m.models), [])
        assert step_tokens  # now front end 1 counts the steps
        os.close(pipes[1])
        started = time.monotonic()
        loop.run()  # the last front end is gone: the loop aborts what runs and ends
        assert time.monotonic() - started < 2
        assert not core_engine.has_unfinished_requests()
        assert core_engine.block_pool.num_used_by(core_engine.owner) == 0
    finally:
        for sock in (*senders, *readers, *(c.inbound for c in channels), *(c.outbound for c in channels)):
            sock.close(linger=0)
        context.term()


@pytest.mark.parametrize(
    ("env", "device", "tp", "count", "cuda_available", "want"),
    [
        ("", "cuda", 1, 1, False, True),  # unset: the core process on CUDA
        ("", None, 1, 1, True, True),  # unset, no --device, a CUDA machine
        ("", None, 1, 1, False, False),  # unset, no --device, a CPU machine: one process
        ("", "cpu", 1, 1, True, False),  # CPU by name: one process
        ("", "cuda", 2, 1, True, False),  # tensor parallelism: one process (the core does not support it yet)
        ("0", "cuda", 1, 1, True, False),  # asked for one process
        ("1", "cpu", 1, 1, False, True),  # asked for the core process, on CPU too
        ("", "cpu", 1, 2, False, True),  # several API servers imply it
    ],
)
def test_the_core_process_is_the_default_on_cuda(monkeypatch, env, device, tp, count, cuda_available, want):
    """``qserve serve`` runs the engine core in its own process on CUDA unless told otherwise (measured on
    the H100: issue 27's targets met at a 1,024-token budget), and in one process on CPU or with tensor
    parallelism, where nothing names the variable. Decided without starting CUDA."""
    import argparse

    import torch

    from qserve.commands.serve import check_engine_core_process

    monkeypatch.setenv("QSERVE_ENABLE_MULTIPROCESSING", env)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # resolving a CUDA device would set it where unset
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    args = argparse.Namespace(device=device, api_server_count=count, tenants=None)
    assert check_engine_core_process(args, tp) is want
    assert not torch.cuda.is_initialized()


def test_tensor_parallelism_with_the_core_process_by_name_is_refused(monkeypatch):
    import argparse

    from qserve.commands.serve import check_engine_core_process

    monkeypatch.setenv("QSERVE_ENABLE_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 is not supported yet"):
        check_engine_core_process(argparse.Namespace(device="cuda", api_server_count=1, tenants=None), 2)
