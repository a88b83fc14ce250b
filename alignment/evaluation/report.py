"""The side-by-side report of ``tools/evaluate.py``: one row per checkpoint, one column per suite
metric (Markdown), the comparisons against the baseline (win rates with 95 % intervals,
regressions), ``results.json`` and one PNG of bar charts (matplotlib, no display needed)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3f}"
    return str(v)


def metrics_table(results: dict[str, dict[str, dict]]) -> str:
    """Markdown tables of ``results`` (checkpoint -> suite -> metrics): one per suite, a row per
    checkpoint, a column per metric any checkpoint has."""
    suites: dict[str, list[str]] = {}
    for found in results.values():
        for suite, values in found.items():
            suites.setdefault(suite, [])
            suites[suite] += [m for m in values if m not in suites[suite]]
    tables = []
    for suite, columns in suites.items():
        lines = [f"| {suite} | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
        for name, found in results.items():
            lines.append(f"| {name} | " + " | ".join(_fmt(found.get(suite, {}).get(m, "")) for m in columns) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def comparison_table(comparisons: dict[str, dict[str, dict]], baseline: str) -> str:
    """Markdown table of win rates against ``baseline`` (checkpoint -> judge -> :func:`win_rate`)."""
    lines = [f"| checkpoint vs {baseline} | judge | wins | ties | losses | win rate | 95 % CI |",
             "|---|---|---|---|---|---|---|"]
    for name, judges in comparisons.items():
        for judge, w in judges.items():
            lines.append(f"| {name} | {judge} | {w['wins']} | {w['ties']} | {w['losses']} | {w['win_rate']:.3f} | "
                         f"[{w['ci_low']:.3f}, {w['ci_high']:.3f}] |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict]], path: str | Path) -> Path:
    """One bar chart per suite metric, a bar per checkpoint, in one PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for suites in results.values():
        for suite, found in suites.items():
            panels += [(suite, m) for m in found if (suite, m) not in panels and m != "skipped"]
    cols = min(4, max(1, len(panels)))
    rows = math.ceil(len(panels) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    names = list(results)
    for ax, (suite, m) in zip(axes.flat, panels):
        values = [float(results[n].get(suite, {}).get(m, float("nan"))) for n in names]
        ax.bar(range(len(names)), values, color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
        ax.set_title(f"{suite}: {m}", fontsize=8)
        if any(w in m for w in ("rate", "accuracy", "pass", "maj@")) and "drift" not in m:
            ax.set_ylim(0, 1)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(out_dir: str | Path, report: dict, markdown: str) -> dict[str, Path]:
    """``results.json``, ``results.md`` and ``results.png`` in ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    paths["json"].write_text(json.dumps(report, indent=1, default=str) + "\n")
    paths["md"].write_text(markdown + "\n")
    paths["png"] = plot(report["metrics"], out / "results.png")
    return paths
