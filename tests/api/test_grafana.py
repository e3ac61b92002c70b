"""deploy/grafana/prism-serve.json against a real /metrics scrape: every metric its PromQL reads is
one the server exports, and every metric the server exports has a panel (so neither can drift)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import API_KEY

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "prism-serve.json"
METRIC = re.compile(r"(?<![\w:])((?:vllm:|prism_)[A-Za-z0-9_:]*)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported(url: str) -> dict[str, str]:
    """Every series name the server's /metrics has, mapped to its family: a family with no samples
    yet (a counter of errors that never happened) counts by its type's suffixes."""
    names = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            names[family.name + suffix] = family.name
        for s in family.samples:
            names[s.name] = family.name
    return names


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression: panel targets (rows' nested panels too) and template variables."""
    out = []
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        out.extend(t["expr"] for t in panel.get("targets", []))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.extend([var["definition"], var["query"]["query"]])
    return out


def test_grafana_dashboard_reads_only_exported_metrics_and_covers_them_all(server):
    r = httpx.post(f"{server.base_url}/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "tiny", "prompt": "Hello", "max_tokens": 2}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    names = exported(server.url)
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["templating"]["list"][0] == {**dashboard["templating"]["list"][0],
                                                  "type": "datasource", "query": "prometheus"}  # fmt: skip
    exprs = queries(dashboard)
    assert len(exprs) > 30
    used = set()
    for expr in exprs:
        found = METRIC.findall(expr)
        assert found, f"no prism_* or vllm:* metric in {expr!r}"
        unknown = [m for m in found if m not in names]
        assert not unknown, f"{expr!r} reads {unknown}, which /metrics does not export"
        used.update(names[m] for m in found)
    missing = sorted(f for f in set(names.values()) if f.startswith(("vllm:", "prism_")) and f not in used)
    assert not missing, f"metrics with no panel in {DASHBOARD.name}: {missing}"
