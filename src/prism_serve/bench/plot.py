"""One PNG per bench run: per-model TTFT and TPOT attainment (bars) and the TTFT and TPOT
distributions (CDFs; per model for a few models, else all together).
Titled as live measurements of the endpoint, so a figure is never mistaken for a simulated one."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prism_serve.bench.report import BenchResult

__all__ = ["plot_result"]

_MAX_CDF_LINES = 8  # beyond this the legend hides the plot; all models are drawn as one line


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: list[float], label: str) -> None:
    xs = np.sort(np.asarray(values)) * 1000
    ys = 100 * np.arange(1, len(xs) + 1) / len(xs)
    # start from 0% so a model with one request still draws a visible step
    ax.step(np.r_[xs[0], xs], np.r_[0.0, ys], where="post", label=label, lw=1)


def plot_result(result: BenchResult, path: str | Path, *, title: str | None = None) -> None:
    plt = _pyplot()
    summary = result.summary()
    models = list(summary["models"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    ax = axes[0]
    x = np.arange(len(models))
    width = 0.4
    for k, (metric, label) in enumerate((("ttft_attainment", "TTFT"), ("tpot_attainment", "TPOT"))):
        vals = [100 * summary["models"][m][metric] for m in models]
        ax.bar(x + (k - 0.5) * width, vals, width, label=label)
    ax.set_xticks(x, models, rotation=60, ha="right", fontsize=6 if len(models) > 8 else 8)
    ax.set_ylim(0, 118)  # headroom for the legend above the 100% bars
    ax.set_ylabel("attainment (%)")
    ax.set_title("SLO attainment per model", fontsize=9)
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    for ax, attr, name in ((axes[1], "ttft_s", "TTFT"), (axes[2], "tpot_s", "TPOT")):
        per_model = len(models) <= _MAX_CDF_LINES
        groups = models if per_model else ["(all)"]
        for m in groups:
            vals = [
                getattr(r, attr)
                for r in result.records
                if r.ok and getattr(r, attr) is not None and (not per_model or r.model == m)
            ]
            if vals:
                _cdf(ax, vals, m)
        targets = {getattr(result.slos[m], attr) for m in models}
        if len(targets) == 1:  # one SLO for every model: draw it; several would clutter the plot
            ax.axvline(1000 * targets.pop(), ls=":", color="0.3", lw=1, label="SLO")
        ax.set_ylim(0, 102)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("requests (%)")
        ax.set_title(f"{name} CDF (succeeded requests)", fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="lower right")
    overall = summary["overall"]
    fig.suptitle(
        (title or f"live bench of {result.url}")
        + f": {overall['requests']} requests, {overall['failed']} failed, "
        f"rate scale {result.settings.rate_scale:g} [measured]",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
