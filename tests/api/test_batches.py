"""The batch lane (api/batches.py, api/batch_store.py): the input file's checks and the store on
their own, then a real `prism serve` with a state directory, driven by the official `openai`
client's Files and Batches calls: a batch's answers are what the same requests get one by one,
errors go to the error file, tenants see only their own, cancel and expiry settle every line,
and a SIGKILL mid-batch loses no line and runs none that had finished again."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from prism_serve.api.batch_store import BatchStore, LineSpec, StateDirInUseError
from prism_serve.api.batches import BatchRunner, check_lines, window_seconds
from prism_serve.api.process import free_port, start_server_process, stop_server_process
from prism_serve.api.tenants import hash_key
from prism_serve.errors import InvalidRequestError
from tests.api.conftest import ADMIN_KEY, shm_files

KEY_A, KEY_B = "sk-team-a", "sk-team-b"


def line(cid: str, body: dict, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def chat(model: str, text: str, max_tokens: int = 6) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip


# ---- the checks and the store, without a server ---------------------------------------------------


def test_the_input_file_is_checked_line_by_line():
    raw = "\n".join([
        line("a", chat("smol", "hi")),
        "not json",
        line("a", chat("smol", "again")),  # custom_id repeated
        json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/chat/completions", "body": {}}),
        line("c", chat("smol", "x"), url="/v1/completions"),
        line("d", {"messages": []}),
        line("e", {**chat("smol", "x"), "stream": True}),
        line("f", chat("nobody", "x")),
        "",
        line("g", chat("tiny", "ok")),
    ]).encode()  # fmt: skip
    specs, errors = check_lines(raw, "/v1/chat/completions", lambda m: m in ("smol", "tiny"))
    assert [s.custom_id for s in specs] == ["a", "g"]
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "invalid_method"),
        (5, "mismatched_endpoint"), (6, "missing_required_parameter"), (7, "invalid_request"),
        (8, "model_not_found"),
    ]  # fmt: skip
    assert check_lines(b"\n\n", "/v1/chat/completions", lambda m: True)[1][0]["code"] == "empty_file"
    assert check_lines(b"\xff\xfe", "/v1/chat/completions", lambda m: True)[1][0]["code"] == "invalid_file"


def test_completion_windows():
    assert window_seconds("24h") == 86400 and window_seconds("90s") == 90 and window_seconds("2d") == 172800
    for bad in ("24", "0h", "1w", "31d", "h", "-1h"):
        with pytest.raises(InvalidRequestError, match="completion_window"):
            window_seconds(bad)


def test_the_store_settles_each_line_once_and_finalizing_again_changes_nothing(tmp_path: Path):
    st = BatchStore(tmp_path)
    f = st.add_file(*st.write_file([b"x"]), "t", "batch", "in.jsonl")
    assert st.file(f.id).bytes == 1 and st.file_path(f.id).read_bytes() == b"x"
    specs = [LineSpec(f"c{i}", "smol", {"model": "smol"}) for i in range(4)]
    b = st.add_batch("t", "/v1/chat/completions", f.id, "24h", 86400, {"k": "v"}, specs, None)
    assert st.batch(b)["status"] == "in_progress" and st.batch(b)["metadata"] == {"k": "v"}
    assert [r["idx"] for r in st.todo_of(b, "smol", 2, skip={0})] == [1, 2]
    st.finish_line(b, 1, {"custom_id": "c1", "response": {"status_code": 200}}, failed=False)
    st.finish_line(b, 1, {"custom_id": "c1", "again": True}, failed=True)  # a second finish is ignored
    st.finish_line(b, 2, {"custom_id": "c2", "response": {"status_code": 400}}, failed=True)
    st.settle_rest(b, "batch_cancelled", "cancelled")
    assert st.counts(b) == {"completed": 1, "failed": 3}
    st.finalize(b, "cancelled", "cancelled_at")
    st.finalize(b, "cancelled", "cancelled_at")  # as after a crash mid-finalize: the same files
    card = st.batch(b)
    out = [json.loads(x) for x in st.file_path(card["output_file_id"]).read_text().splitlines()]
    err = [json.loads(x) for x in st.file_path(card["error_file_id"]).read_text().splitlines()]
    assert [x["custom_id"] for x in out] == ["c1"] and "again" not in out[0]
    assert [x["custom_id"] for x in err] == ["c0", "c2", "c3"]
    assert err[0]["error"]["code"] == "batch_cancelled" and err[1]["response"]["status_code"] == 400
    assert card["status"] == "cancelled" and card["cancelled_at"] is not None
    assert {x.purpose for x in st.files("t", None)} == {"batch", "batch_output", "batch_error"}
    with pytest.raises(StateDirInUseError, match="another running server"):
        BatchStore(tmp_path)  # a second server on the same directory would run the same lines
    st.close()
    again = BatchStore(tmp_path)  # reopened: everything is still there
    assert again.batch(b)["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    again.close()


class FakeServer:
    """What BatchRunner asks of the server, in the test's hands: the calls it makes are recorded and
    answered by ``answer(path, body)``."""

    def __init__(self, answer) -> None:
        self.calls: list[tuple[str, dict, dict]] = []
        self.answer = answer
        self.waiting = 0
        self.active = {"hot"}
        self.tenants = {"t": object()}
        self.last_interactive = time.monotonic()
        self.running = self.peak = 0

    async def call(self, path: str, body: bytes, state: dict) -> tuple[int, dict, bytes]:
        self.calls.append((path, json.loads(body), state))
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(0.02)
        self.running -= 1
        return self.answer(path, json.loads(body))

    def runner(self, st: BatchStore, concurrency: int = 2) -> BatchRunner:
        return BatchRunner(st, self.call, concurrency=concurrency, idle_s=3600.0,
                           waiting=lambda: self.waiting, last_interactive=lambda: self.last_interactive,
                           active=lambda m: m in self.active, tenant=self.tenants.get)  # fmt: skip


async def settle(runner: BatchRunner, passes: int = 20) -> None:
    for _ in range(passes):
        runner._pass()
        await asyncio.sleep(0.01)


def test_the_runner_yields_to_interactive_requests_and_runs_active_models_first(tmp_path: Path):
    async def go() -> None:
        st = BatchStore(tmp_path)
        fake = FakeServer(lambda path, body: (200, {"x-request-id": "r"}, b'{"ok": true}'))
        runner = fake.runner(st)
        specs = [LineSpec(f"c{i}", m, {"model": m}) for i, m in enumerate(["cold", "hot", "cold", "hot"])]
        b = st.add_batch("t", "/v1/chat/completions", "file-x", "24h", 86400, None, specs, None)
        fake.waiting = 1  # an interactive request waits for its first token: nothing starts
        await settle(runner)
        assert fake.calls == []
        fake.waiting = 0
        await settle(runner)
        # the active model's lines ran; the cold model's wait (interactive traffic came just now)
        assert [body["model"] for _, body, _ in fake.calls] == ["hot", "hot"]
        assert fake.peak == 1  # one line at a time while interactive requests come
        assert all(state["tenant"] is fake.tenants["t"] and state["batch"].batch_id == b
                   for _, _, state in fake.calls)  # fmt: skip
        fake.last_interactive -= 3601  # no interactive request for a while: the cold model may be loaded
        await settle(runner)
        assert [body["model"] for _, body, _ in fake.calls] == ["hot", "hot", "cold", "cold"]
        assert fake.peak == 2  # the whole lane once interactive traffic is idle
        assert st.batch(b)["status"] == "completed"
        await runner.stop()
        st.close()

    asyncio.run(go())


def test_the_runner_retries_a_full_server_and_never_runs_a_dropped_tenants_lines(tmp_path: Path):
    async def go() -> None:
        st = BatchStore(tmp_path)
        answers = iter([(429, {"retry-after": "0"}, b"{}"), (200, {}, b'{"n": 1}')])
        fake = FakeServer(lambda path, body: next(answers))
        runner = fake.runner(st, concurrency=1)
        b = st.add_batch("t", "/v1/completions", "f", "24h", 86400, None, [LineSpec("a", "hot", {})], None)
        await settle(runner)
        await asyncio.sleep(0.6)  # the retry waits at least half a second
        await settle(runner)
        (line,) = [
            json.loads(x) for x in st.file_path(st.batch(b)["output_file_id"]).read_text().splitlines()
        ]
        assert line["response"]["body"] == {"n": 1} and len(fake.calls) == 2  # the 429 was not recorded
        gone = st.add_batch(
            "nobody", "/v1/completions", "f", "24h", 86400, None, [LineSpec("a", "hot", {})], None
        )
        await settle(runner)
        (line,) = [
            json.loads(x) for x in st.file_path(st.batch(gone)["error_file_id"]).read_text().splitlines()
        ]
        assert line["response"]["status_code"] == 401 and len(fake.calls) == 2  # never called as admin
        await runner.stop()
        st.close()

    asyncio.run(go())


# ---- a real server ----------------------------------------------------------------------------------

CONFIG = """
devices:
  - {{name: "cpu:0", memory: 2GiB, workers: 1}}
models:
  - {{name: smol, dtype: float32, ttft_slo: 30.0, tpot_slo: 2.0}}
  - {{name: tiny, source: "random:smollm2-135m", max_model_len: 512, ttft_slo: 30.0, tpot_slo: 2.0}}
policy: {{name: prism}}
server:
  keys_file: "{keys}"
  admin_key: {admin}
  namespace: "{namespace}"
  state_dir: "{state}"
  request_log: "{log}"
  batch_concurrency: 3
  batch_idle_s: 0.5
"""


class Server:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        keys = tmp / "keys.yaml"
        keys.write_text(yaml.safe_dump({"tenants": [
            {"name": "team-a", "keys": [hash_key(KEY_A)]},
            {"name": "team-b", "keys": [hash_key(KEY_B)], "models": ["tiny"]},
        ]}))  # fmt: skip
        self.namespace = f"batchtest-{os.getpid()}"
        self.config = tmp / "prism.yaml"
        self.config.write_text(CONFIG.format(keys=keys, admin=ADMIN_KEY, namespace=self.namespace,
                                             state=self.state, log=tmp / "requests.jsonl"))  # fmt: skip
        self.start()

    def start(self) -> None:
        self.port = free_port()
        self.log = self.tmp / f"server-{self.port}.log"
        self.proc = start_server_process(self.config, self.port, self.log, log_level="info")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, key: str = KEY_A) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = Server(tmp_path_factory.mktemp("batches"))
    yield srv
    if srv.proc.poll() is None:
        code = stop_server_process(srv.proc)
        assert code in (0, -signal.SIGTERM), srv.log.read_text()
        assert "Traceback" not in srv.log.read_text(), srv.log.read_text()
    for name in shm_files(srv.namespace):  # what the SIGKILLed server could not remove itself
        Path("/dev/shm", name).unlink(missing_ok=True)


def upload(c: openai.OpenAI, lines: list[str], purpose: str = "batch"):
    return c.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose=purpose)


def wait_batch(c: openai.OpenAI, batch_id: str, until: tuple[str, ...], timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while True:
        b = c.batches.retrieve(batch_id)
        if b.status in until:
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.2)


def slo_judged(server: Server) -> float:
    """Requests /metrics judged against an SLO so far."""
    text = httpx.get(f"{server.base_url.removesuffix('/v1')}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "prism_slo_requests"
               for s in f.samples if s.name == "prism_slo_requests_total")  # fmt: skip


def read_jsonl(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def test_a_batch_answers_as_the_same_requests_one_by_one(server: Server):
    c = server.client()
    prompts = ["Say hello.", "Name a colour.", "Count to three.", "What is 2+2?"]
    lines = [line(f"q{i}", chat("smol" if i % 2 else "tiny", p)) for i, p in enumerate(prompts)]
    lines.append(line("bad", {**chat("smol", "x"), "temperature": 9}))  # the server's 400
    f = upload(c, lines)
    assert (f.purpose, f.bytes, f.object) == ("batch", len("\n".join(lines).encode()), "file")
    judged = slo_judged(server)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"job": "eval"})  # fmt: skip
    assert b.status == "in_progress" and b.request_counts.total == 5 and b.metadata == {"job": "eval"}
    b = wait_batch(c, b.id, ("completed",))
    assert (b.request_counts.completed, b.request_counts.failed) == (4, 1)
    assert slo_judged(server) == judged  # a batch line's deadline is its window: not in attainment
    text = httpx.get(f"{server.base_url.removesuffix('/v1')}/metrics").text
    lane = {(s.name, tuple(s.labels.values())): s.value for f in text_string_to_metric_families(text)
            if f.name.startswith("prism_batch") for s in f.samples}  # fmt: skip
    assert lane["prism_batch_lines_finished_total", ("completed",)] >= 4
    assert lane["prism_batch_lines_finished_total", ("failed",)] >= 1
    assert lane["prism_batches", ("completed",)] >= 1 and lane["prism_batch_lines_running", ()] == 0
    assert b.completed_at >= b.finalizing_at >= b.in_progress_at >= b.created_at
    out = read_jsonl(c, b.output_file_id)
    assert [x["custom_id"] for x in out] == ["q0", "q1", "q2", "q3"]  # input order
    for x, (i, p) in zip(out, enumerate(prompts), strict=True):
        assert x["response"]["status_code"] == 200 and x["error"] is None and x["response"]["request_id"]
        alone = c.chat.completions.create(**chat("smol" if i % 2 else "tiny", p))
        assert x["response"]["body"]["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert x["response"]["body"]["model"] == ("smol" if i % 2 else "tiny")
    (bad,) = read_jsonl(c, b.error_file_id)
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "temperature"
    # the Responses API in a batch: its own route's answer
    body = {"model": "tiny", "input": "Say hi.", "max_output_tokens": 4, "temperature": 0}
    r = c.batches.create(input_file_id=upload(c, [line("r", body, url="/v1/responses")]).id,
                         endpoint="/v1/responses", completion_window="24h")  # fmt: skip
    (answer,) = read_jsonl(c, wait_batch(c, r.id, ("completed",)).output_file_id)
    assert answer["response"]["status_code"] == 200 and answer["response"]["body"]["object"] == "response"
    time.sleep(1.5)  # the request log writes its lines out every second
    log = [json.loads(x) for x in (server.tmp / "requests.jsonl").read_text().splitlines()]
    lane = [x for x in log if x.get("lane") == "batch"]  # the 400 never reached a model: not logged
    assert len(lane) == 5 and {x["tenant"] for x in lane} == {"team-a"}
    assert all(x["status"] == 200 for x in lane) and len(log) > len(lane)  # and the lone ones: no lane


def test_a_bad_file_fails_the_batch_and_bad_calls_get_openai_errors(server: Server, capsys):
    c = server.client()
    f = upload(c, [line("a", chat("smol", "x")), "{", line("b", chat("smol", "y"), url="/v1/completions")])
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "failed" and b.request_counts.total == 0 and b.failed_at is not None
    assert [(e.line, e.code) for e in b.errors.data] == [(2, "invalid_json_line"), (3, "mismatched_endpoint")]
    with pytest.raises(openai.NotFoundError):
        c.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        c.batches.create(input_file_id=f.id, endpoint="/v1/models", completion_window="24h")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="soon")  # type: ignore[arg-type]
    notes = upload(c, [line("a", chat("smol", "x"))], purpose="user_data")
    with pytest.raises(openai.BadRequestError, match="purpose 'batch'"):
        c.batches.create(input_file_id=notes.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        upload(c, ["x"], purpose="fine-tune")
    big = httpx.post(f"{server.base_url}/files", headers={"Authorization": f"Bearer {KEY_A}"},
                     files={"file": ("x.jsonl", b"x" * 64)}, data={"purpose": "batch"})  # fmt: skip
    assert big.status_code == 200  # /v1/files has its own size limit, not max_request_bytes
    assert {x.id for x in c.files.list(purpose="user_data")} == {notes.id}
    auth = {"Authorization": f"Bearer {KEY_A}"}
    for query in ("purpose=batch&purpose=user_data", "limit=5&colour=red"):  # FastAPI would let both by
        r = httpx.get(f"{server.base_url}/files?{query}", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("purpose", "colour"), r.text
    assert c.files.delete(notes.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(notes.id)
    assert b.id in {x.id for x in c.batches.list()}
    from prism_serve.cli import main  # `prism batches` prints the caller's batches

    assert main(["batches", "--url", server.base_url.removesuffix("/v1"), "--api-key", KEY_A]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["BATCH", "STATUS"]
    assert any(row.split()[:2] == [b.id, "failed"] for row in table[1:])


def test_tenants_see_only_their_own_files_and_batches_and_models(server: Server):
    a, b = server.client(KEY_A), server.client(KEY_B)
    f = upload(a, [line("a", chat("smol", "x"))])
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        b.files.content(f.id)
    with pytest.raises(openai.NotFoundError):
        b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert f.id not in {x.id for x in b.files.list()}
    mine = upload(b, [line("a", chat("smol", "x")), line("b", chat("tiny", "x"))])
    batch = b.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed"
    assert [(e.line, e.code) for e in batch.errors.data] == [(1, "model_not_found")]
    with pytest.raises(openai.NotFoundError):
        a.batches.retrieve(batch.id)
    admin = server.client(ADMIN_KEY)  # the admin sees every tenant's
    assert {f.id, mine.id} <= {x.id for x in admin.files.list()}
    assert admin.batches.retrieve(batch.id).id == batch.id
    with pytest.raises(openai.AuthenticationError):
        server.client("sk-nobody").files.list()


def test_cancel_and_expiry_settle_every_line(server: Server):
    c = server.client()
    lines = [line(f"c{i}", chat("smol", f"Write a long story number {i}.", 64)) for i in range(30)]
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions",
                         completion_window="24h")  # fmt: skip
    c.batches.cancel(b.id)
    b = wait_batch(c, b.id, ("cancelled",), 60)
    out, err = read_jsonl(c, b.output_file_id), read_jsonl(c, b.error_file_id)
    assert b.request_counts.completed + b.request_counts.failed == 30 == len(out) + len(err)
    assert {x["custom_id"] for x in out + err} == {f"c{i}" for i in range(30)}
    assert any(x["error"] and x["error"]["code"] == "batch_cancelled" for x in err)
    with pytest.raises(openai.BadRequestError, match="cancelled"):
        c.batches.cancel(b.id)
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions",
                         completion_window="3s")  # type: ignore[arg-type]  # fmt: skip
    b = wait_batch(c, b.id, ("expired",), 60)
    err = read_jsonl(c, b.error_file_id)
    assert b.expired_at is not None and any(x["error"]["code"] == "batch_expired" for x in err if x["error"])
    assert len(read_jsonl(c, b.output_file_id)) + len(err) == 30


def test_a_sigkill_mid_batch_loses_no_line_and_reruns_none_that_finished(server: Server):
    c = server.client()
    lines = [line(f"k{i}", chat("smol", f"Tell me fact number {i}.", 8)) for i in range(12)]
    b = c.batches.create(input_file_id=upload(c, lines).id, endpoint="/v1/chat/completions",
                         completion_window="24h")  # fmt: skip
    while c.batches.retrieve(b.id).request_counts.completed < 3:
        time.sleep(0.1)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    db = sqlite3.connect(f"file:{server.state / 'prism.sqlite3'}?mode=ro", uri=True)
    before = {cid: json.loads(r) for cid, r in db.execute(
        "SELECT custom_id, result FROM lines WHERE batch_id = ? AND done = 1", (b.id,))}  # fmt: skip
    db.close()
    assert 3 <= len(before) < 12
    server.start()  # the same state directory
    c = server.client()
    b = wait_batch(c, b.id, ("completed",))
    out = read_jsonl(c, b.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"k{i}" for i in range(12))
    for x in out:
        if x["custom_id"] in before:  # finished before the kill: the same answer, not a second run
            assert x == before[x["custom_id"]]
