"""What ``prism plan`` prints and writes: the answer per policy against the lower bound and each
other, the cost per month, the models at the answer, results.json, the attainment plot (PNG and one
self-contained HTML file) and the deployment found, as a prism.yaml."""

from __future__ import annotations

import html
import io
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import yaml

from prism_serve.config import DeploymentConfig
from prism_serve.sim.plan import METRICS, Confidence, Plan, deployment_yaml, passed

__all__ = ["PROGRESS_FILE", "PlanProgress", "format_plan", "write_plan"]

PROGRESS_FILE = "progress.json"


class PlanProgress:
    """What a running plan has found (``plan(on_point=...)``): per policy (and variant, and draw),
    each count simulated so far with its attainment, whether it passed, and whether it stopped
    early. ``show`` gets a one-line summary after every point (each policy's last count); with
    ``out``, the same is rewritten to ``out/progress.json`` (whole, then renamed), so a plan
    stopped before its report (interrupted, killed, out of time) still tells how far each sweep
    got. ``done`` removes it once results.json holds it all."""

    def __init__(
        self, metric: str, target: float, out: Path | None = None, show: Callable[[str], None] | None = None
    ) -> None:
        self.metric, self.target, self.out, self.show = metric, target, out, show
        self.points: dict[str, dict[int, dict]] = {}
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, label: str, n: int, point: dict) -> None:
        entry = {
            "attainment": point.get(METRICS[self.metric]),
            "passed": passed(point, self.metric, self.target) if METRICS[self.metric] in point else False,
            "stopped": point.get("stopped"),
            "screened_out": point.get("screened_out"),
            "wall_s": point.get("wall_s"),
        }
        with self._lock:
            self.points.setdefault(label, {})[n] = entry
            self._last[label] = n
            line = self.summary()
            if self.out is not None:
                self.out.mkdir(parents=True, exist_ok=True)
                path = self.out / PROGRESS_FILE
                tmp = path.with_suffix(".tmp")
                data = {lb: {str(k): v for k, v in sorted(pts.items())} for lb, pts in self.points.items()}
                tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
                os.replace(tmp, path)
        if self.show is not None:
            self.show(line)

    def summary(self) -> str:
        """Each sweep's last count: ``prism 14: 98.71%``, ``prism 13: stopped at 97.51%`` (a count
        that stopped early, with its attainment over the requests it saw), ``screened out``."""
        parts = []
        for label, n in self._last.items():
            e = self.points[label][n]
            got = "?" if e["attainment"] is None else f"{e['attainment']:.2%}"
            if e["screened_out"]:
                got = "screened out"
            elif e["stopped"]:
                got = f"stopped at {got}"
            parts.append(f"{label} {n}: {got}")
        return "; ".join(parts)

    def done(self) -> None:
        if self.out is not None:
            (self.out / PROGRESS_FILE).unlink(missing_ok=True)


def _money(x: float | None) -> str:
    return "-" if x is None else f"${x:,.0f}"


def format_plan(plan: Plan, chosen: str) -> str:
    """The summary table, then ``chosen``'s models at its answer."""
    b = plan.bound
    hw = plan.hardware
    kind = "synthetic datasheet profile" if hw.synthetic else "fitted profile"
    lines = [
        f"[simulated: {hw.name}, {kind}] {plan.num_requests} requests over {plan.span_s:.0f} s; target "
        f"{plan.target:.2%} {plan.metric.upper()} attainment",
        f"lower bound: {b.devices} devices (memory {b.memory_devices}, compute {b.compute_devices}, "
        f"tensor parallel {b.tp_devices})",
        "",
        f"| policy | devices | / bound | {plan.metric.upper()} at it | saves vs dedicated | "
        "saves vs static | per month |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p in plan.policies.items():
        n = p.devices
        at = p.answer[f"{plan.metric}_attainment"] if p.answer else None
        devices = str(n) if n is not None else f"> {plan.max_devices}"
        ratio = f"{plan.bound.ratio(n):.2f}x" if n is not None else "-"
        saves = [plan.saving(name, other) for other in ("dedicated", "static-partition")]
        cells = ["-" if s is None else str(s) for s in saves]  # negative: it needs more
        lines.append(
            f"| {name} | {devices} | {ratio} | {'-' if at is None else f'{at:.2%}'} | {cells[0]} | "
            f"{cells[1]} | {_money(plan.monthly_cost(n))} |"
        )
    firsts = [name for name, q in plan.policies.items() if q.confirmed == 0 and q.devices is not None]
    if firsts:
        lines += [
            "",
            f"{', '.join(firsts)}: the first count that passes (a baseline may keep that assignment and "
            "leave more devices idle); the others' answers pass with the counts above them too",
        ]
    stepped = [f"{name} {len(q.skipped)}" for name, q in plan.policies.items() if q.skipped]
    if stepped:
        lines += [
            "",
            f"counts stepped over below the answer (not simulated): {', '.join(stepped)}. Past its first "
            "counts the search took growing steps and then halved the gap, so the count below each answer "
            "fails but these were not tried; if attainment is not monotone in the devices one could pass "
            "(--sweep-counts all tries every count)",
        ]
    p = plan.policies.get(chosen)
    if p is not None and p.confidence is not None:
        lines += ["", *_sure(plan, chosen, p.confidence, p.devices)]
    if p is not None and p.answer is not None and "prefix_hit_rate" in p.answer:
        lines += [
            "",
            f"prefix cache: {p.answer['prefix_hit_rate']:.1%} of prompt tokens found cached at {chosen}'s "
            f"answer (an unbounded cache per model: {p.answer['prefix_hit_rate_infinite']:.1%})",
        ]
    if p is not None and p.answer is not None:
        lines += ["", f"{chosen} at {p.devices} devices, per model:", ""]
        lines += [
            "| model | requests | TTFT | TPOT | replicas | co-located with | misses cold | misses warm |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for model, m in p.answer["per_model"].items():
            replicas = max(1, len(m["by_replica"]))
            colocated = ", ".join(m["colocated"][:4]) + (" ..." if len(m["colocated"]) > 4 else "")
            lines.append(
                f"| {model} | {m['requests']} | {m['ttft_attainment']:.2%} | {m['tpot_attainment']:.2%} | "
                f"{replicas} | {colocated or '-'} | {m['ttft_misses_cold']} | {m['ttft_misses_warm']} |"
            )
    return "\n".join(lines)


def _sure(plan: Plan, chosen: str, c: Confidence, answer: int | None) -> list[str]:
    """What ``--confidence`` found: the count to deploy, then each count tried with its draws'
    attainment range."""
    metric = plan.metric.upper()
    varied = (
        f"each with one of the profile's {c.step_errors} measured step errors"
        if c.step_errors
        else "the profile records no measured step error (prism fit-hardware records them): the traffic "
        "alone varies"
    )
    if c.devices is not None:
        head = (
            f"{chosen} with {c.level:.0%} confidence: **{c.devices} devices** (the answer on the traffic "
            f"given: {answer}); it meets {plan.target:.2%} {metric} attainment on at least {c.need} of "
            f"{c.seeds} other draws of the traffic"
        )
    else:
        head = (
            f"{chosen} with {c.level:.0%} confidence: more than {plan.max_devices} devices (the answer on "
            f"the traffic given: {answer}); no count up to the limit meets the target on {c.need} of "
            f"{c.seeds} draws"
        )
    how = f"draws: each model's minutes drawn from its own nearby minutes (workload/resample.py), {varied}"
    lines = [head, how, "", f"| devices | draws passed | {metric} attainment over the draws run to the end |"]
    lines.append("|---|---|---|")
    for n, draws in sorted(c.counts.items()):
        att = c.attainments(n)
        stopped = sum(d["stopped"] for d in draws)
        span = "-" if not att else f"{att[0]:.2%} - {att[-1]:.2%} (median {att[len(att) // 2]:.2%})"
        if stopped:
            span += f"; {stopped} stopped early (failed)"
        lines.append(f"| {n} | {c.passed(n)} of {len(draws)} run | {span} |")
    return lines


def write_plan(plan: Plan, config: DeploymentConfig, chosen: str, out: Path, argv: list[str]) -> list[Path]:
    """results.json, plan.png, plan.html and prism.yaml (``chosen``'s answer) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    results = {"argv": argv, **plan.as_dict(), "chosen": chosen}
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    written.append(path)
    fig = _figure(plan)
    fig.savefig(out / "plan.png", dpi=90)
    svg = io.StringIO()
    fig.savefig(svg, format="svg")
    written.append(out / "plan.png")
    (out / "plan.html").write_text(_html(plan, svg.getvalue(), chosen))
    written.append(out / "plan.html")
    answer = plan.policies.get(chosen)
    devices = answer.headline if answer is not None else None
    if devices is not None:
        data = deployment_yaml(config, plan.hardware, devices, chosen, plan.provisioned.get(chosen))
        c = answer.confidence
        sure = (
            f" on at least {c.need} of {c.seeds} draws of the planned traffic ({c.level:.0%} confidence)"
            if c is not None
            else " on the planned traffic"
        )
        header = (
            f"# prism plan: {chosen} on {devices} x {plan.hardware.name} meets {plan.target:.2%} "
            f"{plan.metric.upper()} attainment{sure} (simulated)\n"
            "# The devices are one machine's; more than a machine holds run on a Ray cluster (ray:),\n"
            "# where each node serves the devices its own `devices` section names.\n"
        )
        (out / "prism.yaml").write_text(header + yaml.safe_dump(data, sort_keys=False))
        written.append(out / "prism.yaml")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return written


def _figure(plan: Plan):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    key = f"{plan.metric}_attainment"
    low = max(0, 100 * plan.target - 30)

    def y(a: float) -> float:  # a count far below the target shows on the bottom edge
        return max(100 * a, low)

    for name, p in plan.policies.items():
        # counts run to the end make the curve; a count stopped early (its misses already past the
        # budget) is drawn apart, hollow, at its attainment over the requests it saw
        pts = sorted((n, pt[key]) for n, pt in p.points.items() if "stopped" not in pt)
        line = ax.plot([n for n, _ in pts], [y(a) for _, a in pts], marker="o", ms=3, label=name)[0]
        cut = sorted((n, pt[key]) for n, pt in p.points.items() if "stopped" in pt)
        if cut:
            ax.plot([n for n, _ in cut], [y(a) for _, a in cut], ls="none", marker="o", ms=5, mfc="none",
                    color=line.get_color(), label=f"{name}: stopped early (failed)")  # fmt: skip
        if p.devices is not None:
            ax.plot([p.devices], [100 * p.points[p.devices][f"{plan.metric}_attainment"]], marker="*", ms=11,
                    color=line.get_color())  # fmt: skip
        if p.confidence is not None:  # the other draws of the traffic, at each count they ran
            drawn = [(n, d["attainment"]) for n, draws in p.confidence.counts.items() for d in draws]
            ax.plot([n + 0.15 for n, _ in drawn], [y(a) for _, a in drawn], ls="none", marker="_", ms=6,
                    color=line.get_color(), alpha=0.7, label=f"{name}: other draws")  # fmt: skip
    ax.axhline(100 * plan.target, ls="--", color="0.4", lw=1, label=f"target {plan.target:.0%}")
    ax.axvline(plan.bound.devices, ls=":", color="0.2", lw=1, label=f"lower bound {plan.bound.devices}")
    ax.set_xlabel(f"devices ({plan.hardware.name})")
    ax.set_ylabel(f"{plan.metric.upper()} attainment (%)")
    ax.set_ylim(low, 100.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"prism plan: {plan.num_requests} requests [simulated]", fontsize=9)
    fig.tight_layout()
    return fig


def _html(plan: Plan, svg: str, chosen: str) -> str:
    text = html.escape(format_plan(plan, chosen))
    svg = svg[svg.index("<svg") :]  # the XML prolog and doctype are not HTML
    return (
        "<!doctype html>\n<html><head><meta charset='utf-8'><title>prism plan</title>"
        "<style>body{font-family:sans-serif;margin:2em}pre{font-size:13px}</style></head><body>\n"
        f"<h1>prism plan (simulated)</h1>\n{svg}\n<pre>{text}</pre>\n</body></html>\n"
    )
