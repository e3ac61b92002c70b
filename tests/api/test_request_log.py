"""The request log of a real `prism serve` (api/request_log.py): one JSON line per finished request
with its lengths, outcome, timings and where it ran, never its text; ``prism plan`` reads it as it
is; a SIGKILL of the server loses at most the last second of lines; and the writer rotates by size."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from prism_serve.api.request_log import FLUSH_INTERVAL_S, LogEntry, RequestLog
from prism_serve.workload.traffic import read_traffic
from tests.api.conftest import API_KEY, ServerProcess, shm_files, start_server

CONFIG = """
devices:
  - {{name: "cpu:0", memory: 2GiB, workers: 1}}
models:
  - {{name: smol, dtype: float32, ttft_slo: 30.0, tpot_slo: 2.0}}
server:
  api_keys: [{key}]
  namespace: "{{namespace}}"
  request_log: "{log}"
"""

SECRET = "The password is swordfish-4471"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    tmp = tmp_path_factory.mktemp("request-log")
    srv = start_server(tmp, CONFIG.format(key=API_KEY, log=tmp / "requests.jsonl"))
    srv.request_log = tmp / "requests.jsonl"  # type: ignore[attr-defined]
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait()
    for name in shm_files(srv.namespace):  # what a SIGKILLed server could not remove itself
        Path("/dev/shm", name).unlink(missing_ok=True)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_lines(path: Path, count: int) -> list[dict]:
    deadline = time.monotonic() + 10
    while not path.exists() or len(lines(path)) < count:
        assert time.monotonic() < deadline, (
            f"the request log has {len(lines(path)) if path.exists() else 0} lines"
        )
        time.sleep(0.05)
    return lines(path)


def test_each_request_is_one_line_with_its_outcome_and_no_text(server: ServerProcess) -> None:
    c = OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    c.completions.create(model="smol", prompt=SECRET, max_tokens=8, temperature=0)
    stream = c.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": SECRET}], max_tokens=6, stream=True, n=2
    )
    assert sum(1 for _ in stream) > 0
    r = httpx.post(f"{server.base_url}/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "nobody", "prompt": SECRET})  # fmt: skip
    assert r.status_code == 404
    r = httpx.post(f"{server.base_url}/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "smol", "prompt": "x " * 9000, "max_tokens": 4})  # fmt: skip
    assert r.status_code == 400
    got = wait_lines(server.request_log, 4)  # type: ignore[attr-defined]
    assert SECRET not in server.request_log.read_text() and "swordfish" not in server.request_log.read_text()  # type: ignore[attr-defined]
    done, streamed, unknown, too_long = got[-4:]
    assert (done["model"], done["status"], done["stream"], done["n"], done["max_tokens"]) == (
        "smol",
        200,
        False,
        1,
        8,
    )
    assert done["prompt_tokens"] > 0 and 1 <= done["output_tokens"] <= 8
    assert 0 < done["ttft_s"] <= done["e2e_s"] and done["device"] == "cpu:0" and done["replica"] == "smol"
    assert isinstance(done["cold"], bool) and abs(done["arrival"] - time.time()) < 120
    assert (streamed["stream"], streamed["n"], streamed["status"]) == (True, 2, 200)
    assert 2 <= streamed["output_tokens"] <= 12 and streamed["tpot_s"] is not None
    assert (unknown["status"], unknown["prompt_tokens"], unknown["ttft_s"]) == (404, None, None)
    assert (too_long["status"], too_long["output_tokens"]) == (400, 0)


def test_the_log_is_plannable_as_it_is(server: ServerProcess) -> None:
    t = read_traffic(server.request_log, ["smol"])  # type: ignore[attr-defined]
    assert t.format == "log" and len(t.workload) >= 3 and t.dropped_invalid >= 2  # 404 and 400 are not load


def test_a_sigkill_loses_at_most_the_last_second(server: ServerProcess) -> None:
    c = OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    before = len(lines(server.request_log))  # type: ignore[attr-defined]
    sent = []
    for _ in range(4):
        c.completions.create(model="smol", prompt="Hello", max_tokens=2, temperature=0)
        sent.append(time.time())
    time.sleep(1.0 + FLUSH_INTERVAL_S)  # every line is more than a second old
    c.completions.create(model="smol", prompt="Hello", max_tokens=2, temperature=0)  # may be lost
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    got = lines(server.request_log)  # type: ignore[attr-defined]
    assert len(got) - before >= 4, "lines older than a second were lost"


def test_the_writer_rotates_by_size_and_keeps_what_it_is_told(tmp_path: Path) -> None:
    log = RequestLog(tmp_path / "r.jsonl", max_bytes=2000, keep=2)
    for i in range(60):
        log.write(LogEntry(float(i), "m", False, 1, 16, prompt_tokens=i))
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["r.jsonl", "r.jsonl.1", "r.jsonl.2"]
    kept = [
        json.loads(x)["prompt_tokens"]
        for f in ("r.jsonl.2", "r.jsonl.1", "r.jsonl")
        for x in (tmp_path / f).read_text().splitlines()
    ]
    assert kept == list(range(60 - len(kept), 60))  # the newest lines, in order, none twice
    assert all((tmp_path / f).stat().st_size < 2300 for f in files)
