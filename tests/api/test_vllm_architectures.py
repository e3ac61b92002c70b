"""Another architecture than Llama's on vLLM's engine (Qwen3: per-head q/k norms, heads not
hidden / heads wide), through `prism serve` with `engine: vllm`, against transformers' own
implementation on the same weights; and the built-in engine reading the same checkpoint, as
transformers itself saved it, to the same tokens.

The checkpoint is SYNTHETIC: a two-layer Qwen3 with transformers' random initialisation (seeded,
widened so that greedy choices are not near-ties), saved in fp32 with the SmolLM2 tokenizer."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from openai import OpenAI

from prism_serve.api.process import stop_server_process
from prism_serve.engine.tokenizer import Tokenizer
from tests.api.conftest import ServerProcess, shm_files, start_server
from tests.api.test_vllm_server import VLLM_PYTHON

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory, smollm_hf: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    smol = smollm_hf
    config = Qwen3Config(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=False, initializer_range=0.2, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("qwen3") / "qwen3-tiny"
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, path / name)
    gen = json.loads((smol / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def transformers_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out[len(ids) :]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, qwen3_dir: Path) -> ServerProcess:
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} is missing: run scripts/vllm-server-env.sh"
    config = f"""
devices:
  - {{name: "cpu:0", memory: 2GiB, workers: 1}}
models:
  - {{name: qwen3-tiny, engine: vllm, source: "{qwen3_dir}", dtype: float32, ttft_slo: 60.0, tpot_slo: 5.0}}
policy: {{name: prism, activation_timeout_s: 240}}
vllm_python: "{VLLM_PYTHON}"
server: {{namespace: "{{namespace}}"}}
"""
    srv = start_server(tmp_path_factory.mktemp("qwen3-serve"), config, timeout_s=300)
    yield srv
    code = stop_server_process(srv.proc)
    assert code in (0, -signal.SIGTERM), srv.log_text()[-4000:]
    assert shm_files(srv.namespace) == []


def test_the_builtin_engine_reads_the_checkpoint_transformers_saved(qwen3_dir: Path) -> None:
    """transformers' own ``save_pretrained`` (its config writes RoPE as ``rope_parameters``)."""
    from prism_serve.engine.llm import LLM
    from prism_serve.engine.sampling_params import SamplingParams

    llm = LLM(model=str(qwen3_dir), dtype="float32", num_kv_blocks=64)
    assert llm.engine.model.config.qk_norm and llm.engine.model.config.head_dim == 64
    ids = Tokenizer.from_hf_dir(qwen3_dir).encode(PROMPT)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == transformers_greedy(qwen3_dir, ids, 8)


def test_qwen3_on_vllm_in_prism_matches_transformers(server: ServerProcess, qwen3_dir: Path) -> None:
    tok = Tokenizer.from_hf_dir(qwen3_dir)
    ids = tok.encode(PROMPT)
    expected = transformers_greedy(qwen3_dir, ids, 8)
    c = OpenAI(base_url=server.base_url, api_key="unused", timeout=240, max_retries=0)
    r = c.completions.create(model="qwen3-tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    assert r.choices[0].text == tok.decode(expected)
    models = {m.id: m for m in c.models.list().data}
    card = models["qwen3-tiny"].model_extra
    assert card["state"] == "active"
    # activated at start-up or by this request: on the engine its worker built ahead (compiled),
    # the weights in by the load plan checked on this architecture (q/k norms, an untied head)
    assert card["engine_compiled"] is True and card["weights_loaded_by"] == "plan", card
