"""lm-eval-harness `local-completions` against a real `prism serve`: a loglikelihood task (what
MMLU, ARC and HellaSwag are) scored through echo + logprobs. The task and its data are local
(tests/clients/data) and the tokenizer lm-eval needs for context lengths is the default model's,
written to disk: lm-eval runs offline, as its own command, as a user runs it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.clients.conftest import API_KEY, DATA, MODEL

ROOT = Path(__file__).resolve().parents[2]
TASK = "prism_tiny_mc"
LIMIT = 3  # documents; four choices each, so 12 loglikelihood requests


def run_lm_eval(server, tokenizer_dir: Path, out: Path, batch_size: int = 1) -> subprocess.CompletedProcess:
    """`lm-eval run --model local-completions` on the tiny task, writing under ``out``."""
    args = {"model": MODEL, "base_url": f"{server.base_url}/completions", "tokenizer": str(tokenizer_dir),
            "tokenizer_backend": "huggingface", "max_retries": 1}  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
           "--model_args", ",".join(f"{k}={v}" for k, v in args.items()), "--tasks", TASK,
           "--include_path", str(DATA), "--limit", str(LIMIT), "--batch_size", str(batch_size),
           "--log_samples", "--output_path", str(out)]  # fmt: skip
    # the task's data_files are relative to the repository root
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def read_outputs(done: subprocess.CompletedProcess, out: Path) -> tuple[dict, list[dict]]:
    """lm-eval's results and per-document samples, once it exited 0."""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    (results,) = out.glob("*/results_*.json")
    (samples,) = out.glob(f"*/samples_{TASK}_*.jsonl")
    return json.loads(results.read_text()), [json.loads(line) for line in samples.read_text().splitlines()]


@pytest.fixture(scope="module")
def one_by_one(server, tokenizer_dir, tmp_path_factory) -> tuple[dict, list[dict]]:
    """lm-eval run once with one prompt a request: its results and samples (both tests read them)."""
    out = tmp_path_factory.mktemp("lm-eval-single")
    return read_outputs(run_lm_eval(server, tokenizer_dir, out), out)


def test_lm_eval_local_completions_loglikelihood(server, one_by_one):
    results, samples = one_by_one
    scores = results["results"][TASK]
    assert 0.0 <= scores["acc,none"] <= 1.0 and 0.0 <= scores["acc_norm,none"] <= 1.0
    assert len(samples) == LIMIT
    for sample in samples:
        assert len(sample["filtered_resps"]) == len(sample["doc"]["choices"])
        for loglik, is_greedy in sample["filtered_resps"]:
            assert math.isfinite(float(loglik)) and float(loglik) < 0 and is_greedy in ("True", "False")

    # The first document's first choice scored again by hand: echo + logprobs of context +
    # continuation, summed over the continuation's tokens (lm-eval splits the whole text's tokens
    # after the context's own)
    first = samples[0]["arguments"]["gen_args_0"]
    context, continuation = first["arg_0"], first["arg_1"]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    num_context = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": context},
                             headers=auth, timeout=60).json()["count"]  # fmt: skip
    r = httpx.post(f"{server.base_url}/completions", headers=auth, timeout=120, json={
        "model": MODEL, "prompt": context + continuation, "echo": True, "logprobs": 1, "max_tokens": 1,
        "temperature": 0,
    }).json()  # fmt: skip
    num_prompt = r["usage"]["prompt_tokens"]
    assert num_prompt > num_context
    by_hand = sum(r["choices"][0]["logprobs"]["token_logprobs"][num_context:num_prompt])
    assert float(samples[0]["filtered_resps"][0][0]) == pytest.approx(by_hand, abs=1e-3)


def test_lm_eval_batched_prompts(server, tokenizer_dir, tmp_path, one_by_one):
    """lm-eval's documented local-completions setup batches: batch_size=N puts N token lists in one
    request's `prompt` and reads N choices back by index; the scores match those of one prompt per
    request."""
    done = run_lm_eval(server, tokenizer_dir, tmp_path / "batched", batch_size=4)
    results, samples = read_outputs(done, tmp_path / "batched")
    assert 0.0 <= results["results"][TASK]["acc,none"] <= 1.0 and len(samples) == LIMIT

    def scores(docs: list[dict]) -> list[float]:
        return [float(r[0]) for d in sorted(docs, key=lambda d: d["doc_id"]) for r in d["filtered_resps"]]

    assert scores(samples) == pytest.approx(scores(one_by_one[1]), abs=1e-4)
