"""Structured outputs on models that cannot write JSON by themselves — the demo model (a
4M-parameter toy; ``slow``: on a loaded 2-core machine its steps take a while) and a tiny
random Llama (fast): every constrained output parses and validates, greedy and sampled, alone
and batched with unconstrained requests in the same steps; grammars are compiled once per
schema; bad constraints are refused before anything is queued."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from qserve import LLM, SamplingParams
from qserve.structured.grammar import GrammarError
from qserve.structured.params import StructuredOutputsParams
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

DEMO = Path(__file__).resolve().parents[3] / "recipes" / "demo" / "model"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "city": {"type": "string", "maxLength": 10},
            },
            "required": ["zip", "city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "tags", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"enum": ["a1", "b2"]}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER}
PROMPTS = ["def parse_args(", "import os\n", "class Config:", "    return self."]


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    return LLM(str(DEMO), device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=512, seed=0)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = save_tiny_checkpoint(make_tiny_model("LlamaForCausalLM", seed=0), tmp_path_factory.mktemp("tiny"))
    return LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=512, seed=0)


def _check(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def _mixed_batch(llm: LLM, max_tokens: int) -> None:
    """Both schemas, greedy and sampled, next to unconstrained rows, all in the same steps."""
    params, schemas = [], []
    for i, schema in enumerate((PERSON, ORDER)):
        constrained = StructuredOutputsParams(json=schema)
        params += [
            SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constrained),
            SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=constrained),
            SamplingParams(
                temperature=1.2, top_p=0.95, seed=10 + i, max_tokens=max_tokens, structured_outputs=constrained
            ),
        ]
        schemas += [schema] * 3
    params += [SamplingParams(temperature=0.0, max_tokens=16), SamplingParams(temperature=0.9, seed=3, max_tokens=16)]
    schemas += [None, None]
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    for output, schema in zip(outputs, schemas):
        completion = output.outputs[0]
        if schema is None:
            assert completion.finish_reason == "length"  # the free rows were not cut short
            continue
        assert completion.finish_reason == "stop", completion.text
        _check(completion.text, schema)
    assert len(llm.engine._grammar_matchers) == 0  # finished sequences leave no matcher behind


@pytest.mark.slow
def test_demo_model_json_schemas_greedy_and_sampled_batched_with_free_requests(demo_llm):
    _mixed_batch(demo_llm, 160)


@pytest.mark.slow
def test_demo_model_many_samples_all_validate(demo_llm):
    params = SamplingParams(
        temperature=1.0, seed=7, n=4, max_tokens=160, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    (output,) = demo_llm.generate(["def f("], params)
    texts = [c.text for c in output.outputs]
    for text in texts:
        _check(text, PERSON)
    assert len(set(texts)) > 1  # sampling still samples


def test_tiny_model_json_schemas_greedy_and_sampled_batched_with_free_requests(llm):
    _mixed_batch(llm, 200)


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(llm):
    free = SamplingParams(temperature=0.0, max_tokens=20)
    alone = llm.generate(["def main("], free)[0].outputs[0].text
    mixed = llm.generate(
        ["def main(", "x = "],
        [free, SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=ORDER))],
    )
    assert mixed[0].outputs[0].text == alone
    _check(mixed[1].outputs[0].text, ORDER)


def test_json_object_regex_choice_grammar(llm):
    params = [
        SamplingParams(
            temperature=0.7, seed=1, max_tokens=80, structured_outputs=StructuredOutputsParams(json_object=True)
        ),
        SamplingParams(
            temperature=0.7,
            seed=2,
            max_tokens=30,
            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,5}-[0-9]{2}"),
        ),
        SamplingParams(
            temperature=0.7,
            seed=3,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no", 'maybe "so"']),
        ),
        SamplingParams(
            temperature=0.7,
            seed=4,
            max_tokens=30,
            structured_outputs=StructuredOutputsParams(
                grammar='root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
            ),
        ),
    ]
    outs = [o.outputs[0] for o in llm.generate(["a", "b", "c", "d"], params)]
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert isinstance(json.loads(outs[0].text), dict)
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", outs[1].text)
    assert outs[2].text in ("yes", "no", 'maybe "so"')
    assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", outs[3].text)


def test_grammar_compiled_once_per_schema(llm):
    compiler = llm.engine.grammar_compiler
    schema = {"type": "object", "properties": {"v": {"enum": [1, 2, 3]}}, "required": ["v"]}
    before = compiler.num_compiled
    for seed in range(3):
        params = SamplingParams(
            temperature=1.0, seed=seed, max_tokens=20, structured_outputs=StructuredOutputsParams(json=schema)
        )
        _check(llm.generate(["x"], params)[0].outputs[0].text, schema)
    # The same schema as JSON text with other spacing: the same grammar.
    again = StructuredOutputsParams(json=json.dumps(schema, indent=2))
    llm.generate(["y"], SamplingParams(max_tokens=20, structured_outputs=again))
    assert compiler.num_compiled == before + 1


def test_bad_constraints_are_refused_before_queuing(llm):
    with pytest.raises(GrammarError, match="regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")))
    with pytest.raises(GrammarError, match="grammar"):
        llm.generate(
            ["x"], SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= undefined_rule"))
        )
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    assert not llm.engine.has_unfinished_requests()


def test_llm_chat_matches_generate_on_the_rendered_prompt(llm, capsys):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (chatted,) = llm.chat(conversation, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert chatted.prompt == text and text.endswith("<|im_start|>assistant\n")
    (generated,) = llm.generate(
        {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}, params, use_tqdm=False
    )
    assert chatted.outputs[0].token_ids == generated.outputs[0].token_ids
    assert "Processed prompts" not in capsys.readouterr().err
    # Several conversations, with a progress bar.
    outputs = llm.chat([conversation, conversation[1:]], params, use_tqdm=True)
    assert len(outputs) == 2 and outputs[0].outputs[0].token_ids == chatted.outputs[0].token_ids
    assert "Processed prompts" in capsys.readouterr().err
    with pytest.raises(ValueError, match="conversation 1"):
        llm.chat([conversation, []], params)
