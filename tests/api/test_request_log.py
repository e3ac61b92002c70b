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

from prism_serve.api.request_log import (
    FLUSH_INTERVAL_S,
    LOG_BLOCK_TOKENS,
    LogEntry,
    RequestLog,
    prompt_block_hashes,
)
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


def test_prompt_block_hashes_match_up_to_the_first_differing_block() -> None:
    a = list(range(1000, 1300))  # 4 full 64-token blocks and 44 tokens
    b = a.copy()
    b[130] = 7  # in block 2
    ha, hb = prompt_block_hashes(a), prompt_block_hashes(b)
    assert len(ha) == len(hb) == 4 and len(set(ha)) == 4
    assert ha[:2] == hb[:2]
    assert all(x != y for x, y in zip(ha[2:], hb[2:], strict=True))  # chained: every later block too
    assert prompt_block_hashes(a[:299]) == ha and prompt_block_hashes(a[:63]) == []
    assert prompt_block_hashes(a, 100) != ha[:3] and len(prompt_block_hashes(a, 100)) == 3
    assert all(0 <= h < 2**63 for h in ha)


def test_prompt_block_hashes_are_the_same_in_every_process() -> None:
    import subprocess
    import sys

    code = "from prism_serve.api.request_log import prompt_block_hashes as h; print(h(list(range(500))))"
    out = {
        seed: subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert out["1"] == out["2"] == f"{prompt_block_hashes(list(range(500)))}\n"


def test_logged_hashes_become_the_planned_workloads_block_hashes(tmp_path: Path) -> None:
    from prism_serve.workload.prefix import infinite_cache_hits

    shared = list(range(2000, 2128))  # two blocks
    prompts = [shared + list(range(5000, 5172)), shared + list(range(7000, 7172))]
    path = tmp_path / "requests.jsonl"
    lines = []
    for i, ids in enumerate(prompts):
        entry = LogEntry(100.0 + i, "smol", False, 1, 8, prompt_tokens=len(ids), output_tokens=8)
        entry.block_hashes = prompt_block_hashes(ids, LOG_BLOCK_TOKENS)
        lines.append(entry.line())
    plain = LogEntry(103.0, "smol", False, 1, 8, prompt_tokens=40, output_tokens=8)
    assert "block_hashes" not in json.loads(plain.line())  # no prompt hashed: the line as before
    path.write_text("\n".join([*lines, plain.line()]) + "\n")
    logged = json.loads(lines[0])
    assert logged["block_tokens"] == LOG_BLOCK_TOKENS and len(logged["block_hashes"]) == 300 // 64
    w = read_traffic(path, ["smol"]).workload
    assert w.block_tokens == LOG_BLOCK_TOKENS
    assert w.block_hashes == (tuple(logged["block_hashes"]), tuple(json.loads(lines[1])["block_hashes"]), ())
    # the second request finds the two shared blocks in a cache (16-token engine blocks)
    assert infinite_cache_hits(w, 16).tolist() == [0, 128, 0]
