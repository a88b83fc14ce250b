"""TensorBoard logs of a run -> PNG plots of its training curves.

    python tools/plot_metrics.py outputs/grpo_smollm2_arithmetic            # -> <run>/plots/*.png
    python tools/plot_metrics.py RUN_DIR --out plots/ --tags reward/mean kl loss/policy

``RUN_DIR`` is a run's output directory (its ``tensorboard/`` is read) or a TensorBoard log
directory itself. Default tags: reward, KL, entropy, response length and held-out accuracy
(those the run logged). Writes one PNG per tag (``/`` in a tag becomes ``_``) and
``metrics.png`` with all of them side by side. Reads the logs with TensorBoard's own
``EventAccumulator`` and draws with matplotlib (no display needed).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

DEFAULT_TAGS = ("reward/mean", "kl", "entropy", "response_length", "heldout/accuracy")


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in a TensorBoard log directory: ``{tag: [(step, value), ...]}`` in
    step order, all events kept (no down-sampling). Raises FileNotFoundError for a missing dir."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    logdir = Path(logdir)
    if not logdir.is_dir():
        raise FileNotFoundError(f"no TensorBoard log directory at {logdir}")
    acc = EventAccumulator(str(logdir), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}


def plot_metrics(run_dir: str | Path, out_dir: str | Path | None = None,
                 tags: tuple[str, ...] | list[str] | None = None) -> list[Path]:
    """Draw the ``tags`` series of a run; returns the PNG paths written (per tag, then
    ``metrics.png``). Default ``tags``: those of :data:`DEFAULT_TAGS` the run logged.

    Raises:
        ValueError: an asked-for tag the run never logged (the message lists those it has).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    logdir = run_dir / "tensorboard" if (run_dir / "tensorboard").is_dir() else run_dir
    series = read_scalars(logdir)
    if tags is None:
        tags = [t for t in DEFAULT_TAGS if t in series]
    missing = [t for t in tags if t not in series]
    if missing or not tags:
        raise ValueError(f"tags {missing or list(DEFAULT_TAGS)} not in {logdir}; it has: {', '.join(sorted(series))}")
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)

    def draw(ax, tag):
        steps, values = zip(*series[tag])
        ax.plot(steps, values, marker="o", markersize=3)
        ax.set_title(tag)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)

    written = []
    for tag in tags:
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        draw(ax, tag)
        fig.tight_layout()
        written.append(out / f"{tag.replace('/', '_')}.png")
        fig.savefig(written[-1])
        plt.close(fig)
    cols = min(3, len(tags))
    rows = math.ceil(len(tags) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), dpi=100, squeeze=False)
    for ax, tag in zip(axes.flat, tags):
        draw(ax, tag)
    for ax in list(axes.flat)[len(tags):]:
        ax.axis("off")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    written.append(out / "metrics.png")
    fig.savefig(written[-1])
    plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run's output directory, or a TensorBoard log directory")
    ap.add_argument("--out", default=None, help="where to write the PNGs (default: RUN_DIR/plots)")
    ap.add_argument("--tags", nargs="+", default=None, help=f"scalar tags (default: those of {DEFAULT_TAGS} present)")
    args = ap.parse_args(argv)
    paths = plot_metrics(args.run_dir, args.out, args.tags)
    for p in paths:
        print(p)
    return paths


if __name__ == "__main__":
    main()
