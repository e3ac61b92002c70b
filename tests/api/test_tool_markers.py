"""Calls under ``tool_choice: auto`` are constrained from their first token in every family's format,
where the family's markers (``<tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>``) are special tokens
of the model's vocabulary (Qwen's GGUF, Mistral, Llama 3) as where they are plain text.

The vocabulary with special markers is SmolLM2's with four unused special tokens renamed (ids 8, 9,
12, 13: ``<issue_start>``, ``<issue_comment>``, ``<jupyter_text>``, ``<jupyter_code>``). The grammars
are checked with llguidance against that tokenizer; the served model is a small Llama of random
weights (labelled synthetic) over it, on the built-in engine and on vLLM's: ``logit_bias`` on the
marker token makes it start a call, and from there the grammar must make the call valid."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import llguidance
import openai
import pytest
from jsonschema import validate
from tokenizers import Tokenizer as HFTokenizer

from prism_serve.api.process import stop_server_process
from prism_serve.api.tools import (
    MARKERS,
    ToolChoice,
    ToolFormat,
    auto_grammar,
    parse_calls,
    parse_tools,
    render_conversation,
)
from prism_serve.engine.sources import default_gguf_path, gguf_header
from prism_serve.engine.tokenizer import Tokenizer
from tests.api.conftest import API_KEY, ServerProcess, shm_files, start_server

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("PRISM_VLLM_PYTHON", ROOT / ".venv-vllm-server/bin/python"))
RENAMED = {8: "<tool_call>", 9: "</tool_call>", 12: "<|python_tag|>", 13: "[TOOL_CALLS]"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]}, "days": {"type": "integer",
                           "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
        },
    },
}  # fmt: skip
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
SCHEMA = WEATHER["function"]["parameters"]
TOOLS = parse_tools([WEATHER, TIME])


def smollm_tokenizer(renamed: bool) -> Tokenizer:
    """SmolLM2's tokenizer (from the default GGUF's header), with the marker tokens or without."""
    tok = Tokenizer.from_gguf_metadata(gguf_header(default_gguf_path())[0])
    if not renamed:
        return tok
    state = json.loads(tok.backend.to_str())
    for added in state["added_tokens"]:
        if added["id"] in RENAMED:
            del state["model"]["vocab"][added["content"]]
            added["content"] = RENAMED[added["id"]]
            state["model"]["vocab"][added["content"]] = added["id"]
    return Tokenizer(
        HFTokenizer.from_str(json.dumps(state)), bos_token_id=tok.bos_token_id,
        eos_token_ids=tok.eos_token_ids, add_bos=False, chat_template=tok.chat_template,
    )  # fmt: skip


@pytest.fixture(scope="module", params=[True, False], ids=["special-markers", "text-markers"])
def vocab(request) -> tuple[Tokenizer, llguidance.LLTokenizer]:
    tok = smollm_tokenizer(request.param)
    return tok, llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=[2])


def accepts(vocab, family: str, text: str, parallel: bool = True) -> bool:
    """Whether the family's auto grammar takes ``text`` (as this vocabulary encodes it) as a whole answer."""
    tok, ll = vocab
    fmt = ToolFormat(family, tok.special_ids(MARKERS[family]))
    matcher = llguidance.LLMatcher(ll, llguidance.grammar_from("lark", auto_grammar(TOOLS, parallel, fmt)))
    assert not matcher.is_error(), matcher.get_error()
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


# answers each family's grammar takes, and the calls the parser reads from them
GOOD = {
    "hermes": [
        ('Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
         "</tool_call>",
         "Let me look.", [("get_weather", {"city": "Oslo", "days": 2})]),
        ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
         '{"name": "get_weather", "arguments": {"city": "Rome", "days": 7}}\n</tool_call>',
         None, [("get_time", {}), ("get_weather", {"city": "Rome", "days": 7})]),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}, '
         '{"name": "get_time", "arguments": {}}]',
         None, [("get_weather", {"city": "Paris", "days": 1}), ("get_time", {})]),
    ],
    "llama3_json": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
         None, [("get_weather", {"city": "Paris", "days": 3})]),
        ('{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}',
         None, [("get_time", {}), ("get_time", {})]),
    ],
    "json": [
        ('[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 5}}]',
         None, [("get_weather", {"city": "Oslo", "days": 5})]),
    ],
}  # fmt: skip
# calls the grammar refuses, each at the token that goes wrong
BAD = {
    "hermes": ['<tool_call>{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}</tool_call>',
               '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
               "<tool_call>not json</tool_call>"],
    "mistral": ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
                "Sure [TOOL_CALLS] [] and more"],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": "Oslo", "days": 9}}',
                    '{"answer": 42}', '<|python_tag|>print("hi")'],
    "json": ['{"name": "get_time", "arguments": {"tz": "UTC"}}', '[1, 2, 3]'],
}  # fmt: skip
TEXT = ["The weather in Paris is mild.", "", "Use get_weather(city) for that.\n\nOr not."]


@pytest.mark.parametrize("family", list(GOOD))
def test_each_familys_calls_and_text_pass_its_grammar_and_parse_back(vocab, family):
    tok, _ = vocab
    for text, content, calls in GOOD[family]:
        assert accepts(vocab, family, text), (family, text)
        ids = tok.encode(text, add_special_tokens=False)
        got_content, got = parse_calls(tok.decode(ids, skip_special_tokens=False), family, TOOLS)
        assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls
    for text in TEXT:
        assert accepts(vocab, family, text), (family, text)


@pytest.mark.parametrize("family", list(BAD))
def test_a_call_that_would_not_validate_cannot_be_written(vocab, family):
    for text in BAD[family]:
        assert not accepts(vocab, family, text), (family, text)


def test_without_parallel_calls_one_call_ends_the_answer(vocab):
    two = GOOD["hermes"][1][0]
    assert accepts(vocab, "hermes", two) and not accepts(vocab, "hermes", two, parallel=False)
    two = GOOD["mistral"][0][0]
    assert accepts(vocab, "mistral", two) and not accepts(vocab, "mistral", two, parallel=False)


def test_the_system_message_asks_for_calls_in_the_format_they_are_read_in():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}  # fmt: skip
    turns = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "call_2"}]},
    ]

    class Msg:
        def __init__(self, d):
            self.role, self.content, self.tool_calls = d["role"], d["content"], d.get("tool_calls")

        def text(self):
            return self.content or ""

    for family in MARKERS:
        msgs, shown = render_conversation([Msg(t) for t in turns], TOOLS, ToolChoice("auto"), None, family)
        assert shown is None and msgs[0]["role"] == "system"
        asked = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": '"parameters"'}
        assert asked.get(family, '"arguments"') in msgs[0]["content"]
        # the earlier calls, as the model was asked to write them, read back as those calls
        content, calls = parse_calls(msgs[2]["content"], family, TOOLS)
        assert (
            content is None
            and [(c.name, json.loads(c.arguments)) for c in calls]
            == [("get_weather", {"city": "Oslo", "days": 2})] * 2
        ), family


# ---- served --------------------------------------------------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FAMILIES = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>"}
VLLM_FAMILY = "hermes"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama of random weights (synthetic) over SmolLM2's vocabulary with the markers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True, torch_dtype="float32", bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("markers") / "tiny-markers"
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    smollm_tokenizer(True).backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"})
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> ServerProcess:
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: run scripts/vllm-server-env.sh"
    entries = "".join(
        f'  - {{name: {family}, source: "{model_dir}", tool_parser: {family}, dtype: float32}}\n'
        for family in FAMILIES
    ) + (
        f'  - {{name: {VLLM_FAMILY}-vllm, engine: vllm, source: "{model_dir}", tool_parser: {VLLM_FAMILY}, '
        "dtype: float32}\n"
    )
    config = f"""
devices:
  - {{name: "cpu:0", memory: 2GiB, workers: 1}}
models:
{entries}policy: {{name: prism, activation_timeout_s: 240}}
vllm_python: "{VLLM_PYTHON}"
vllm_compile: false  # eager: the compiled build is test_vllm_server.py's to check; here it costs minutes
server: {{namespace: "{{namespace}}", api_keys: [{API_KEY}]}}
"""
    srv = start_server(tmp_path_factory.mktemp("markers-serve"), config, timeout_s=300)
    yield srv
    code = stop_server_process(srv.proc)
    assert code in (0, -signal.SIGTERM), srv.log_text()[-4000:]
    assert shm_files(srv.namespace) == []


# every family on the built-in engine; on vLLM's, one (the constraint and the parsing are the API
# layer's, the same for both engines: a second and third vLLM activation add a minute and no check)
@pytest.mark.parametrize(
    "family, engine",
    [(f, "") for f in FAMILIES] + [(VLLM_FAMILY, "-vllm")],
    ids=[*FAMILIES, f"{VLLM_FAMILY}-vllm"],
)
def test_a_call_the_model_starts_is_a_valid_call(server, family, engine):
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=240)
    marker = next(i for i, m in RENAMED.items() if m == FAMILIES[family])
    kw = dict(
        model=family + engine, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
        parallel_tool_calls=False, temperature=0, max_tokens=120, logit_bias={str(marker): 100},
    )  # fmt: skip
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    validate(json.loads(call.function.arguments), SCHEMA)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(
        call.function.arguments
    )
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    # unbiased, the random model answers in text: content, no call, and no marker left in it
    del kw["logit_bias"]
    r = client.chat.completions.create(**{**kw, "max_tokens": 16})
    message = r.choices[0].message
    assert message.tool_calls is None or all(c.function.name == "get_weather" for c in message.tool_calls)
    assert FAMILIES[family] not in (message.content or "")
