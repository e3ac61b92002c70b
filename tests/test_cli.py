from __future__ import annotations

import socket
import subprocess
import sys


def run_prism(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prism_serve.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_a_completion_of_the_default_model():
    res = run_prism("generate", "What is the capital of France?", "--max-tokens", "20", "-v")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    assert "finish_reason=stop" in res.stderr


def test_generate_reports_bad_input_as_named_errors():
    res = run_prism("generate", "hi", "--model", "/no/such/model.gguf")
    assert res.returncode == 2
    assert "WeightsNotFoundError" in res.stderr and "/no/such/model.gguf" in res.stderr
    res = run_prism("generate", "hi", "--max-tokens", "0")
    assert res.returncode == 2
    assert "InvalidSamplingParamsError" in res.stderr and "max_tokens" in res.stderr


def test_generate_labels_synthetic_weights():
    res = run_prism("generate", "hi", "--model", "random:smollm2-135m", "--max-tokens", "3", "--raw")
    assert res.returncode == 0, res.stderr
    assert "synthetic weights" in res.stderr


def test_serve_refuses_a_taken_port_before_starting_anything():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = run_prism("serve", "--port", str(port), "--log-level", "info")
    assert res.returncode == 2, res.stderr
    assert f"ListenError: cannot listen on 127.0.0.1:{port}" in res.stderr
    assert "Application startup" not in res.stderr and "serving" not in res.stderr.split("OpenAI endpoint")[1]


def test_serve_names_a_host_it_cannot_listen_on():
    res = run_prism("serve", "--host", "no-such-host.invalid", "--port", "8000")
    assert res.returncode == 2, res.stderr
    assert "ListenError: cannot listen on no-such-host.invalid:8000" in res.stderr
