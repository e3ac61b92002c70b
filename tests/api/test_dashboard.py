"""The /dashboard page in a real headless browser (Debian's Chromium, set up by
scripts/ensure-chromium.sh) against the real server of conftest.py: the page's own script fetches
/dashboard/state with the key from its URL fragment and renders it; the test compares what Chromium
rendered with the JSON, and takes a screenshot."""

from __future__ import annotations

import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
WINDOW = (1280, 900)


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:  # a failure, not a skip: the dashboard is only tested here
        pytest.fail("chromium is not installed: run scripts/ensure-chromium.sh (Debian's package, as root)")
    return path


def browse(url: str, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """Chromium, headless, on ``url``; 5 s of virtual time lets the page poll a few times (virtual
    time stops while a fetch is in flight, so each poll gets its answer)."""
    cmd = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        "--no-first-run", f"--user-data-dir={tmp / 'profile'}", "--virtual-time-budget=5000",
        f"--window-size={WINDOW[0]},{WINDOW[1]}", *args, url,
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


class Page(HTMLParser):
    """The rendered DOM: devices (name -> fields and bar segments), model rows (id -> fields),
    tenant rows (name -> fields), and a few single elements by id."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.devices: dict[str, dict] = {}
        self.models: dict[str, dict] = {}
        self.tenants: dict[str, dict] = {}
        self.by_id: dict[str, dict] = {}
        self._device: str | None = None
        self._model: str | None = None
        self._tenant: str | None = None
        self._text_of: dict | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if "data-device" in a:
            self._device, self._model = a["data-device"], None
            self.devices[self._device] = {"fields": {}, "segments": []}
        elif tag == "tr" and "data-model" in a:
            self._model, self._device, self._tenant = a["data-model"], None, None
            self.models[self._model] = {}
        elif tag == "tr" and "data-tenant" in a:
            self._tenant, self._device, self._model = a["data-tenant"], None, None
            self.tenants[self._tenant] = {}
        if "id" in a:
            self.by_id[a["id"]] = {**a, "text": ""}
            self._text_of = self.by_id[a["id"]] if a["id"] in ("status", "summary") else None
        if self._device and "seg" in a.get("class", "").split():
            self.devices[self._device]["segments"].append(a)
        elif self._device and "data-field" in a:
            self.devices[self._device]["fields"][a["data-field"]] = a["data-value"]
        elif (self._model or self._tenant) and "data-field" in a:
            field = {"value": a.get("data-value"), "text": ""}
            row = self.models[self._model] if self._model else self.tenants[self._tenant]
            row[a["data-field"]] = field
            self._text_of = field

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "b", "span"):
            self._text_of = None

    def handle_data(self, data: str) -> None:
        if self._text_of is not None:
            self._text_of["text"] += data


def state(url: str) -> dict:
    return httpx.get(f"{url}/dashboard/state", headers=AUTH, timeout=30).json()


@pytest.fixture
def url(server) -> str:
    return server.url


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_page_is_self_contained_and_its_state_needs_the_key(url):
    r = httpx.get(f"{url}/dashboard", timeout=30)  # the page holds no data: open
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    for external in ("http://", "https://", "<link", "src=", "@import"):
        assert external not in html, f"the page loads something from elsewhere ({external})"
    assert httpx.get(f"{url}/dashboard/state", timeout=30).status_code == 401
    bad = httpx.get(f"{url}/dashboard/state", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    ok = httpx.get(f"{url}/dashboard/state", headers=AUTH, timeout=30)
    assert ok.status_code == 200 and ok.json()["object"] == "dashboard.state"


def test_chromium_renders_live_state(url, tmp_path):
    for model, n in (("tiny", 3), ("smol", 1)):
        for i in range(n):
            body = {"model": model, "prompt": f"Count to {i + 3}:", "max_tokens": 4}
            r = httpx.post(f"{url}/v1/completions", headers=AUTH, json=body, timeout=120)
            assert r.status_code == 200, r.text
    before = state(url)
    page = Page(browse(f"{url}/dashboard#key={API_KEY}", tmp_path, "--dump-dom").stdout)
    after = state(url)

    status = page.by_id["status"]
    assert status["class"] == "ok" and status["text"].startswith("live"), status
    assert "hidden" in page.by_id["keyform"], "the key from the URL fragment was not used"

    # devices: every one, with its budget and each model's weights and KV as the ledger has them
    assert set(page.devices) == {d["name"] for d in after["devices"]} == {"cpu:0", "cpu:1"}
    for d in after["devices"]:
        shown = page.devices[d["name"]]
        assert int(shown["fields"]["budget_bytes"]) == d["budget_bytes"] == 2 * 2**30
        stable = d == next(x for x in before["devices"] if x["name"] == d["name"])
        segs = {(s.get("data-model"), s["data-kind"]): int(s["data-bytes"]) for s in shown["segments"]}
        if stable:  # nothing mapped or unmapped while Chromium looked
            want = {(u["model"], u["kind"]): u["bytes"] for u in d["uses"] if u["bytes"] > 0}
            want[(None, "free")] = d["free_bytes"]
            assert segs == want, d["name"]
            assert int(shown["fields"]["used_bytes"]) == d["used_bytes"]
        for (model, kind), nbytes in segs.items():
            if kind == "weights":  # a model's weights segment holds at least its weights
                card = next(m for m in after["models"] if m["id"] == model)
                assert nbytes >= card["weight_bytes"]
    assert any(s["data-kind"] == "weights" for d in page.devices.values() for s in d["segments"])

    # models: every one, with its state, load and recent TTFT and attainment
    assert set(page.models) == {m["id"] for m in after["models"]} == {"smol", "smol-b", "tiny"}
    for m in after["models"]:
        row = page.models[m["id"]]
        assert row["id"]["text"] == m["id"]
        assert int(row["num_activations"]["value"]) >= 0
        if m != next(x for x in before["models"] if x["id"] == m["id"]):
            continue  # it changed while Chromium looked: the page showed one of the two
        assert row["state"]["value"] == row["state"]["text"] == m["state"]
        assert row["devices"]["value"] == ",".join(r["device"] for r in m["replicas"])
        for field in ("num_running", "num_queued", "num_activations"):
            assert int(row[field]["value"]) == m[field], field
        for field in ("ttft_p50", "ttft_p95", "ttft_attainment", "tpot_attainment"):
            want = m["recent"][field]
            assert (row[field]["value"] == "") if want is None else float(row[field]["value"]) == want, field
    tiny = next(m for m in after["models"] if m["id"] == "tiny")
    assert tiny["recent"]["num_finished"] >= 3 and tiny["state"] == "active"
    p50 = page.models["tiny"]["ttft_p50"]
    assert float(p50["value"]) > 0 and p50["text"].endswith(("ms", " s")), p50
    assert page.models["tiny"]["ttft_attainment"]["text"].endswith("%")
    assert "of 3 models active" in page.by_id["summary"]["text"]

    # tenants: the plain api_keys' tenant, its requests and SLO attainment as the JSON has them
    (default,) = after["tenants"]
    row = page.tenants["default"]
    assert "hidden" not in page.by_id["tenants-section"] and row["tenant"]["text"] == "default"
    assert int(row["admitted"]["value"]) >= 4 and row["in_flight"]["text"] == "\u2013"  # no limit
    for field, want in (("ttft_attainment", default["slo_attainment"]["ttft"]), ("slo_scale", 1.0)):
        assert float(row[field]["value"]) == want, field


def test_chromium_without_a_key_asks_for_one(url, tmp_path):
    page = Page(browse(f"{url}/dashboard", tmp_path, "--dump-dom").stdout)
    assert "hidden" not in page.by_id["keyform"]
    assert page.by_id["status"]["text"] == "an API key is needed"
    assert page.devices == {} and page.models == {}


def test_screenshot(url, tmp_path):
    shot = tmp_path / "dashboard.png"
    browse(f"{url}/dashboard#key={API_KEY}", tmp_path, f"--screenshot={shot}")
    assert png_size(shot) == WINDOW
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one (blank: a few KB)
