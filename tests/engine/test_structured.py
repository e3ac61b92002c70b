"""Structured output on the real SmolLM2: constrained decoding yields text in the requested
language, greedy and sampled, ends when the language is complete, and refuses a bad spec when
the request is added."""

from __future__ import annotations

import json
import re

import pytest

from prism_serve.engine.sampling_params import SamplingParams, StructuredOutput
from prism_serve.errors import InvalidSamplingParamsError
from prism_serve.runtime import messages as msg
from tests.conftest import run_to_completion

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def chat(engine, question: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))


def solo(engine, prompt, params):
    req = engine.add_request(prompt, params)
    return run_to_completion(engine)[req]


def assert_person(text: str, extra_keys: bool = True) -> dict:
    """The schema above, checked by hand (no jsonschema dependency): an object with a string name
    and an integer age (JSON booleans are not integers)."""
    value = json.loads(text)
    assert isinstance(value, dict)
    assert isinstance(value["name"], str)
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
    if not extra_keys:
        assert set(value) == {"name", "age"}
    return value


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 0.7, "seed": 2}],
    ids=["greedy", "sampled-1", "sampled-2"],
)
def test_json_schema_output_parses_and_validates(engine, sampling):
    prompt = chat(engine, "Give the name and age of a person as JSON with the keys name and age only.")
    structured = StructuredOutput("json_schema", json.dumps(PERSON))
    out = solo(engine, prompt, SamplingParams(max_tokens=64, structured=structured, **sampling))
    assert out.finish_reason == "stop"
    assert_person(out.text)


def test_closed_schema_ends_the_request_when_the_object_closes(engine):
    prompt = chat(engine, "Describe a person called Alice who is 30, as JSON.")
    closed = StructuredOutput("json_schema", json.dumps({**PERSON, "additionalProperties": False}))
    out = solo(engine, prompt, SamplingParams(temperature=0, max_tokens=64, structured=closed))
    assert out.finish_reason == "stop"
    assert assert_person(out.text, extra_keys=False) == {"name": "Alice", "age": 30}
    free = solo(engine, prompt, SamplingParams(temperature=0, max_tokens=24))
    with pytest.raises(ValueError):
        json.loads(free.text)  # unconstrained, the model writes prose or a longer object


def test_json_object_regex_and_grammar(engine):
    prompt = chat(engine, "Give the name and age of a person as JSON.")
    obj = solo(
        engine,
        prompt,
        SamplingParams(temperature=0, max_tokens=64, structured=StructuredOutput("json_object")),
    )
    assert isinstance(json.loads(obj.text), dict)

    pattern = r"[0-9]{3}-[a-z]{2,5}"
    params = SamplingParams(
        temperature=1.0, seed=4, max_tokens=32, structured=StructuredOutput("regex", pattern)
    )
    rx = solo(engine, chat(engine, "Write a code."), params)
    assert rx.finish_reason == "stop" and re.fullmatch(pattern, rx.text), rx.text

    lark = 'start: answer "!"\nanswer: "yes" | "no"'
    yes_no = SamplingParams(temperature=0, max_tokens=16, structured=StructuredOutput("grammar", lark))
    g = solo(engine, chat(engine, "Is Paris in France?"), yes_no)
    assert g.finish_reason == "stop" and g.text in ("yes!", "no!")


def test_constrained_request_leaves_its_batch_neighbours_unchanged(make_engine):
    engine = make_engine(max_num_seqs=4, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    prompts = [chat(engine, q) for q in ("What is 12 plus 30?", "Name three primary colors.")]
    alone = [solo(engine, p, greedy).token_ids for p in prompts]
    structured = SamplingParams(
        temperature=0, max_tokens=64, structured=StructuredOutput("json_schema", json.dumps(PERSON))
    )
    ids = [engine.add_request(p, greedy) for p in prompts]
    constrained = engine.add_request(chat(engine, "A person as JSON, name and age only."), structured)
    final = run_to_completion(engine)
    assert [final[i].token_ids for i in ids] == alone
    assert_person(final[constrained].text)


@pytest.mark.parametrize(
    ("structured", "match"),
    [
        (StructuredOutput("json_schema", '{"type": "objectx"}'), "objectx"),
        (StructuredOutput("regex", "[0-9]+("), "regex"),
        (StructuredOutput("grammar", "start: missing_rule"), "missing_rule"),
    ],
    ids=["bad-type", "bad-regex", "bad-grammar"],
)
def test_spec_that_does_not_compile_is_refused_at_add_time(engine, structured, match):
    params = SamplingParams(structured=structured)
    with pytest.raises(InvalidSamplingParamsError, match=match):
        engine.add_request("hi", params)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("structured", "match"),
    [
        (StructuredOutput("xml"), "structured.kind"),
        (StructuredOutput("json_schema", "{not json"), "structured.spec"),
        (StructuredOutput("json_schema", "[1, 2]"), "structured.spec"),
        (StructuredOutput("regex"), "structured.spec"),
        ({"kind": "json_object"}, "structured"),
    ],
)
def test_bad_structured_params_name_the_field(structured, match):
    with pytest.raises(InvalidSamplingParamsError, match=match):
        SamplingParams(structured=structured)


def test_structured_params_cross_the_worker_boundary():
    params = SamplingParams(max_tokens=5, structured=StructuredOutput("json_schema", json.dumps(PERSON)))
    decoded = msg.to_worker_decoder().decode(msg.encode(msg.AddRequest("r1", [1, 2], params)))
    assert decoded.params == params
    assert decoded.params.structured == StructuredOutput("json_schema", json.dumps(PERSON))
