"""The deployment config: YAML -> validated pydantic, errors naming key and line."""

from __future__ import annotations

import json
import os

import pytest

from prism_serve.cli import main
from prism_serve.config import ConfigError, ModelConfig, default_config, load_config, parse_config
from prism_serve.engine.machine import resolve_dtype
from prism_serve.runtime.build import device_specs, model_specs
from prism_serve.runtime.devices import DeviceSpec

GOOD = """\
devices:
  - {name: "cpu:0", memory: 1GiB, cores: "0", workers: 1}
  - name: "cpu:1"
    memory: 512MiB
models:
  - {name: chat, ttft_slo: 2.5, tpot_slo: 0.3, pinned: true, max_model_len: 1024}
  - {name: synth, source: "random:smollm2-360m", dtype: bfloat16, kv_limit: 64MiB, seed: 3}
policy:
  name: prism
  knobs: {idle_threshold_s: 30}
server: {port: 9000, api_keys: [a, b], admin_key: root, max_waiting_requests: 10}
"""


def test_good_config_maps_onto_runtime_types():
    c = parse_config(GOOD)
    devices = device_specs(c)
    assert devices[0] == DeviceSpec("cpu:0", 2**30, (0,), 1)
    assert devices[1].memory_bytes == 512 * 2**20 and devices[1].cores == () and devices[1].num_workers == 2
    chat, synth = model_specs(c)
    assert (chat.name, chat.ttft_slo, chat.tpot_slo, chat.pinned, chat.engine.max_model_len) == (
        "chat",
        2.5,
        0.3,
        True,
        1024,
    )
    assert (synth.source, synth.engine.dtype, synth.kv_limit_bytes, synth.engine.seed) == (
        "random:smollm2-360m", "bfloat16", 64 * 2**20, 3,
    )  # fmt: skip
    assert c.policy.knobs == {"idle_threshold_s": 30}
    assert c.server.api_keys == ["a", "b"] and c.server.port == 9000


def test_auto_dtype_is_bf16_on_a_deployment_of_gpus_and_explicit_dtypes_stay():
    gpus = GOOD.replace('"cpu:0", memory: 1GiB, cores: "0", workers: 1', '"cuda:0", memory: 1GiB').replace(
        '"cpu:1"', '"cuda:1"'
    )
    chat, synth = model_specs(parse_config(gpus))
    assert (chat.engine.dtype, synth.engine.dtype) == ("bfloat16", "bfloat16")
    fp32 = gpus.replace("dtype: bfloat16", "dtype: float32")
    assert model_specs(parse_config(fp32))[1].engine.dtype == "float32"
    mixed = GOOD.replace('"cpu:1"', '"cuda:0"')  # a CPU among the devices: the CPU's rule
    assert model_specs(parse_config(mixed))[0].engine.dtype == resolve_dtype("auto")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD.replace("workers: 1}", "workers: 1, colour: red}"), "devices.0.colour (line 2): unknown key"),
        (
            GOOD.replace("    memory: 512MiB", "    memory: 512MiB\n    memroy: 1"),
            "devices.1.memroy (line 5): unknown key",
        ),
        (GOOD.replace("server: {", "sever: {"), "sever (line 11): unknown key"),
        (
            GOOD.replace("idle_threshold_s", "idle_treshold_s"),
            "unknown knob(s) idle_treshold_s for policy prism",
        ),
        (GOOD.replace("name: prism", "name: fifo"), "unknown policy 'fifo'"),
        (GOOD.replace("memory: 1GiB", "memory: lots"), "devices.0.memory (line 2): cannot parse size 'lots'"),
        (
            GOOD.replace("ttft_slo: 2.5", "ttft_slo: -1"),
            "models.0.ttft_slo (line 6): Input should be greater than 0",
        ),
        (GOOD.replace("name: synth", "name: chat"), "duplicate model name(s): chat"),
        (GOOD.replace("dtype: bfloat16", "dtype: fp8"), "models.1.dtype (line 7)"),
        (GOOD.replace('"cpu:1"', '"tpu:1"'), "devices.1.name (line 3)"),
        ("devices: 3\nmodels: [{name: a}]\n", "devices (line 1): wrong type (int)"),
        ("- just a list\n", "must be a mapping"),
        ("devices: [\n", "not valid YAML"),
    ],
)
def test_errors_name_the_key_and_line(text, expected):
    with pytest.raises(ConfigError) as e:
        parse_config(text, "deploy.yaml")
    assert expected in str(e.value)
    assert str(e.value).startswith("deploy.yaml")


def test_a_tensor_parallel_model_is_served_over_tp_devices():
    """``tp: 4`` goes through to the runtime's spec (the runtime runs it as four workers; tests in
    tests/runtime/test_tensor_parallel_runtime.py)."""
    config = parse_config(GOOD.replace("seed: 3}", "seed: 3, tp: 4}"))
    assert config.models[1].tp == 4
    assert [s.tp for s in model_specs(config)] == [1, 4]


def test_load_config_file(tmp_path):
    path = tmp_path / "prism.yaml"
    path.write_text(GOOD)
    assert load_config(path).server.port == 9000
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_default_config_serves_real_and_synthetic_models():
    c = default_config()
    sources = [m.source for m in c.models]
    assert sources.count("smollm2-135m-instruct") >= 2
    assert any(s.startswith("random:") for s in sources)
    # the real model answers greedily unless asked otherwise (README: measured), the synthetic ones sample
    for m in c.models:
        synthetic = m.source.startswith("random:")
        assert m.sampling_defaults() == ({} if synthetic else {"temperature": 0.0}), m.name
    devices = device_specs(c)
    assert len(devices) == 2
    assert {core for d in devices for core in d.cores} == set(os.sched_getaffinity(0))


def test_overrides_are_validated():
    c = parse_config(GOOD).with_overrides(port=1234, policy="static-partition")
    assert c.server.port == 1234 and c.policy.name == "static-partition" and c.policy.knobs == {}
    with pytest.raises(ConfigError, match="unknown policy"):
        c.with_overrides(policy="nope")


def test_a_ray_section_or_the_ray_flag_serves_on_a_cluster():
    assert parse_config(GOOD).ray is None
    c = parse_config(GOOD + "ray: {address: auto}\n")
    assert c.ray.address == "auto" and c.ray.poll_interval_s == 0.5
    assert c.with_overrides(ray_address="10.0.0.1:6379").ray.address == "10.0.0.1:6379"
    assert parse_config(GOOD).with_overrides(ray_address="auto").ray.address == "auto"
    with pytest.raises(ConfigError, match="adress"):
        parse_config(GOOD + "ray: {adress: auto}\n")
    with pytest.raises(ConfigError, match="poll_interval_s"):
        parse_config(GOOD + "ray: {poll_interval_s: 0}\n")


def test_serve_with_a_bad_config_exits_2_naming_the_key(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(GOOD.replace("server: {", "servr: {"))
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and "servr (line 11): unknown key" in err


def test_model_names_cannot_contain_the_replica_separator():
    with pytest.raises(ConfigError, match="name"):
        parse_config("models:\n  - {name: 'a#1'}\n")


def test_an_expected_rate_is_a_finite_non_negative_rate_given_to_the_model_spec():
    c = parse_config(
        "devices: {count: 1, memory: 1GiB}\nmodels:\n  - {name: a, expected_rate: 0.25}\n  - {name: b}\n"
    )
    assert [s.expected_rate for s in model_specs(c)] == [0.25, None]
    for bad in ("-1", ".nan", ".inf", "fast"):
        with pytest.raises(ConfigError, match=r"models\.0\.expected_rate"):
            parse_config(
                f"devices: {{count: 1, memory: 1GiB}}\nmodels:\n  - {{name: a, expected_rate: {bad}}}\n"
            )


def test_a_vllm_model_needs_a_local_directory_and_a_python_with_vllm(tmp_path, monkeypatch):
    from prism_serve.runtime.build import vllm_python

    model_dir = tmp_path / "qwen3"
    model_dir.mkdir()
    text = f"""\
devices: [{{name: "cpu:0", memory: 1GiB}}]
models:
  - {{name: q, engine: vllm, source: "{model_dir}"}}
"""
    c = parse_config(text)
    assert model_specs(c)[0].engine_kind == "vllm"
    with pytest.raises(ConfigError, match=r"models\.0.*not one"):
        parse_config(text.replace(str(model_dir), str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match=r"models\.0\.engine"):
        parse_config(text.replace("engine: vllm", "engine: sglang"))

    monkeypatch.chdir(tmp_path)  # no .venv-vllm-server here
    monkeypatch.delenv("PRISM_VLLM_PYTHON", raising=False)
    with pytest.raises(ConfigError, match=r"vllm-server-env\.sh"):
        vllm_python(c)
    python = tmp_path / "python"
    python.write_text("")
    assert vllm_python(parse_config(text + f'vllm_python: "{python}"\n')) == str(python)
    monkeypatch.setenv("PRISM_VLLM_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="not a file"):
        vllm_python(c)
    # a deployment without vLLM models needs none
    assert vllm_python(parse_config(GOOD)) is None


def _hf_dir(tmp_path, generation: str | None):
    """A Hugging Face layout directory with a config.json and, given, a generation_config.json."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 100}')
    if generation is not None:
        (d / "generation_config.json").write_text(generation)
    return d


def test_sampling_defaults_come_from_the_config_over_the_generation_config(tmp_path):
    hf = _hf_dir(tmp_path, '{"do_sample": true, "temperature": 0.6, "top_p": 0.95, "top_k": 20, '
                 '"max_new_tokens": 512, "eos_token_id": 2, "repetition_penalty": 1.1}')  # fmt: skip
    text = f'devices: {{count: 1, memory: 1GiB}}\nmodels:\n  - {{name: a, source: "{hf}"}}\n'
    a = parse_config(text).models[0]
    assert a.sampling_defaults() == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "max_tokens": 512,
        "repetition_penalty": 1.1,
    }
    text = text.replace('"}\n', '", sampling: {temperature: 0.2, min_p: 0.05}}\n')
    b = parse_config(text).models[0]
    assert b.sampling_defaults()["temperature"] == 0.2 and b.sampling_defaults()["min_p"] == 0.05
    assert b.sampling_defaults()["top_p"] == 0.95  # the generation config's, where the config is silent
    assert dict(model_specs(parse_config(text))[0].sampling) == b.sampling_defaults()
    # no generation config, and a synthetic model: OpenAI's defaults (nothing set)
    plain = parse_config("devices: {count: 1, memory: 1GiB}\nmodels: [{name: c}]").models[0]
    assert plain.sampling_defaults() == {}


@pytest.mark.parametrize(
    ("generation", "message"),
    [
        ('{"do_sample": false, "temperature": 0.7}', None),  # greedy, as transformers reads it
        ('{"temperature": "hot"}', "temperature must be a number"),
        ('{"top_p": 0}', "top_p: Input should be greater than 0"),
        ("[1, 2]", "not a JSON object"),
        ("{", "not readable JSON"),
    ],
)
def test_a_generation_config_is_checked_and_named(tmp_path, generation, message):
    hf = _hf_dir(tmp_path, generation)
    text = f'devices: {{count: 1, memory: 1GiB}}\nmodels: [{{name: a, source: "{hf}"}}]'
    model = parse_config(text).models[0]
    if message is None:
        assert model.sampling_defaults() == {"temperature": 0.0}
        return
    with pytest.raises(ConfigError, match=message) as e:
        model.sampling_defaults()
    assert "model a" in str(e.value)


def test_sampling_defaults_in_the_config_are_validated():
    with pytest.raises(ConfigError, match="temperature"):
        parse_config("devices: {count: 1, memory: 1GiB}\nmodels: [{name: a, sampling: {temperature: 3}}]")
    with pytest.raises(ConfigError, match="tempreature"):
        parse_config("devices: {count: 1, memory: 1GiB}\nmodels: [{name: a, sampling: {tempreature: 0.1}}]")


ADAPTER_BASE = """
devices: [{name: "cpu:0", memory: 2GiB}]
models:
  - {name: base}
  - {name: plain, source: "random:smollm2-135m"}
"""


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("{name: a, base: base}", "needs both base and adapter"),
        ("{name: a, adapter: /x}", "needs both base and adapter"),
        ("{name: a, base: nope, adapter: /x}", "base 'nope' is not a model of this config"),
        ("{name: a, base: base, adapter: /x, dtype: float32}", "dtype belong on the base"),
        ("{name: a, base: base, adapter: /x, max_model_len: 64}", "max_model_len belong on the base"),
    ],
)
def test_adapter_entries_are_checked(entry, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_config(ADAPTER_BASE + f"  - {entry}\n")


def test_a_base_gets_adapter_slots_where_it_has_adapters_and_adapters_get_no_engine():
    config = parse_config(ADAPTER_BASE + "  - {name: a, base: base, adapter: /x, ttft_slo: 3}\n")
    specs = {s.name: s for s in model_specs(config)}
    assert set(specs) == {"base", "plain"}  # the adapter runs in its base's engine
    assert specs["base"].engine.max_loras == 8 and specs["plain"].engine.max_loras == 0
    base = config.models[0]
    # SLOs it leaves out are its base's, also once the config is dumped and validated again
    for c in (config, config.with_overrides(port=9000)):
        assert [(a.name, a.base, a.ttft_slo, a.tpot_slo) for a in c.adapters()] == [
            ("a", "base", 3.0, base.tpot_slo)
        ]
    with pytest.raises(ConfigError, match="max_loras: 0"):
        parse_config(ADAPTER_BASE.replace("{name: base}", "{name: base, max_loras: 0}")
                     + "  - {name: a, base: base, adapter: /x}\n")  # fmt: skip
    with pytest.raises(ConfigError, match="base 'a' is itself an adapter"):
        parse_config(
            ADAPTER_BASE + "  - {name: a, base: base, adapter: /x}\n  - {name: b, base: a, adapter: /y}\n"
        )


def test_an_embedding_model_pools_as_its_sentence_transformers_files_say_unless_the_config_does(tmp_path):
    from prism_serve.engine.sources import write_embedding_files

    hf = _hf_dir(tmp_path, None)
    write_embedding_files(hf, "mean", True, 576)
    head = "devices: {count: 1, memory: 1GiB}\nmodels:\n"
    text = head + "".join([
        f'  - {{name: a, source: "{hf}", task: embed}}\n',
        f'  - {{name: b, source: "{hf}", task: embed, pooling: last, normalize: false}}\n',
        "  - {name: c, task: embed}\n  - {name: d}\n",
    ])  # fmt: skip
    a, b, c, d = parse_config(text).models

    def pooled(m) -> tuple | None:
        t = m.pooling_task()
        return None if t is None else (t.task, t.pooling, t.normalize)

    assert (pooled(a), pooled(b)) == (("embed", "mean", True), ("embed", "last", False))
    assert pooled(c) == ("embed", "last", True) and pooled(d) is None  # no files; a chat model
    assert [s.pooled for s in model_specs(parse_config(text))] == [a.pooling_task(), b.pooling_task(),
                                                                   c.pooling_task(), None]  # fmt: skip
    write_embedding_files(hf, "cls", False, 576)  # rewritten: no Normalize module any more
    assert pooled(parse_config(text).models[0]) == ("embed", "cls", False)
    (hf / "1_Pooling" / "config.json").write_text(
        '{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true}'
    )
    with pytest.raises(ConfigError, match=r"model a: .*one pooling mode"):
        parse_config(text).models[0].pooling_task()
    with pytest.raises(ConfigError, match="pooling and normalize are for task: embed"):
        parse_config(head + "  - {name: a, pooling: mean}\n")
    # on vLLM's engine: built as a pooling model, pooling as the files say
    write_embedding_files(hf, "cls", False, 576)
    on_vllm = parse_config(head + f'  - {{name: a, source: "{hf}", task: embed, engine: vllm}}\n').models[0]
    assert pooled(on_vllm) == ("embed", "cls", False) and on_vllm.engine_config().pooling == "cls"
    # the built-in engine pools as each request says
    assert parse_config(text).models[0].engine_config().pooling is None
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(ConfigError, match="has a classification head: it scores pairs"):
        on_vllm = parse_config(head + f'  - {{name: a, source: "{hf}", task: embed, engine: vllm}}\n')
        on_vllm.models[0].pooling_task()
    with pytest.raises(ConfigError, match="task"):
        parse_config(head + "  - {name: a, task: rerank}\n")


def test_a_pooled_models_slo_is_one_latency_for_the_whole_request():
    """latency_slo (embed and score) is the deadline every input of a request shares: the TTFT SLO
    admission, placement and the simulator hold each input to; a generating model has none, and a
    pooled model given both must give one."""
    head = "devices: {count: 1, memory: 1GiB}\nmodels:\n"
    e, r, g = parse_config(head + "  - {name: e, task: embed, latency_slo: 0.5}\n"
                           "  - {name: r, task: score}\n  - {name: g}\n").models  # fmt: skip
    assert (e.ttft_slo, e.latency_slo) == (0.5, 0.5) and r.latency_slo is None and r.ttft_slo == g.ttft_slo
    assert [
        s.ttft_slo for s in model_specs(parse_config(head + "  - {name: e, task: embed, latency_slo: 0.5}\n"))
    ] == [0.5]
    again = parse_config(head + "  - {name: e, task: embed, latency_slo: 0.5}\n")
    assert type(again).model_validate(again.model_dump()).models[0].ttft_slo == 0.5  # dumped and read again
    with pytest.raises(ConfigError, match="latency_slo is for task: embed or score"):
        parse_config(head + "  - {name: g, latency_slo: 1.0}\n")
    with pytest.raises(ConfigError, match="give latency_slo or ttft_slo, not both"):
        parse_config(head + "  - {name: e, task: embed, latency_slo: 1.0, ttft_slo: 2.0}\n")
    with pytest.raises(ConfigError, match="latency_slo"):
        parse_config(head + "  - {name: e, task: embed, latency_slo: 0}\n")


def test_a_reranker_fills_its_template_and_reads_its_answer_tokens_from_the_config():
    head = "devices: {count: 1, memory: 1GiB}\nmodels:\n"
    default, own = parse_config(head + "".join([
        "  - {name: a, task: score}\n",
        "  - {name: b, task: score, score_template: 'Q={query} D={document} I={instruction} {x}',\n"
        "     score_instruction: find it, score_tokens: ['No', 'Yes']}\n",
    ])).models  # fmt: skip
    task = default.pooling_task()
    assert (task.task, task.pooling, task.tokens) == ("score", "last", ("no", "yes"))
    prompt = task.prompt("q {document}", "the doc")  # a placeholder inside a text stays as it is
    assert "<Query>: q {document}\n<Document>: the doc<|im_end|>" in prompt
    assert f"<Instruct>: {task.instruction}\n" in prompt and prompt.startswith("<|im_start|>system\n")
    mine = own.pooling_task()
    assert mine.tokens == ("No", "Yes") and mine.prompt("a", "b") == "Q=a D=b I=find it {x}"
    assert mine.prompt("a", "b", "other") == "Q=a D=b I=other {x}"
    for bad, match in [
        ("{name: a, score_tokens: ['no', 'yes']}", "score_tokens are for task: score"),
        ("{name: a, task: score, score_tokens: ['yes', 'yes']}", "two different tokens"),
        ("{name: a, task: score, score_tokens: [no, yes]}", "quote them: YAML reads a bare yes"),
        ("{name: a, task: score, pooling: last}", "pooling and normalize are for task: embed"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_config(head + f"  - {bad}\n")


def test_vllm_pools_embedders_cross_encoders_and_decoder_rerankers(tmp_path):
    """On engine: vllm, what config.json says decides: a classification head of one output scores
    pairs ("classify"), an encoder embeds from its first token unless its files say otherwise, a
    decoder from its last; a decoder without a head scores with its answer tokens' ids, found in
    its tokenizer."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    head = "devices: {count: 1, memory: 1GiB}\nmodels:\n"

    def model(name: str, task: str, extra: str = "", **config) -> ModelConfig:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        backend = Backend(models.WordLevel({"[UNK]": 0, "no": 1, "yes": 2, "Yes": 3}, unk_token="[UNK]"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        backend.save(str(path / "tokenizer.json"))
        entry = f'  - {{name: {name}, task: {task}, engine: vllm, source: "{path}"{extra}}}\n'
        return parse_config(head + entry).models[0]

    cross = model("cross", "score", model_type="modernbert", id2label={"0": "LABEL_0"},
                  architectures=["ModernBertForSequenceClassification"])  # fmt: skip
    assert cross.pooling_task().classifier and cross.engine_config().pooling == "classify"
    assert cross.engine_config().score_tokens is None
    assert model("enc", "embed", model_type="modernbert").engine_config().pooling == "cls"
    assert model("dec", "embed", model_type="qwen3").engine_config().pooling == "last"
    reranker = model("rr", "score", model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    engine = reranker.engine_config()
    assert (engine.pooling, engine.score_tokens) == (
        "classify",
        (1, 2),
    ) and not reranker.pooling_task().classifier
    own = model("own", "score", ", score_tokens: ['no', 'Yes']", model_type="qwen3")
    assert own.engine_config().score_tokens == (1, 3)
    for name, task, extra, config, match in [
        ("two", "score", "", {"model_type": "bert", "architectures": ["BertForSequenceClassification"],
                              "num_labels": 2}, "classification head has 2 outputs"),
        ("enc-score", "score", "", {"model_type": "modernbert"}, "an encoder with no classification head"),
        ("many", "score", ", score_tokens: ['no', 'yes no']", {"model_type": "qwen3"}, "is not one token"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            model(name, task, extra, **config).engine_config()
