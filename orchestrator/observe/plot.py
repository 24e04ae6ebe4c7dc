"""`orch plot RUN [RUN ...] [--out FILE.png]`: one figure of a run's curves per step, read from its
log through the rows the metric sinks get (orchestrator/observe/rows.py); several runs overlaid,
one colour each, named in the legend."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from eventlog import EventLog
from orchestrator.observe.rows import TRAINER_PREFIX, log_rows

# (title, y label, [(row name, line style, label)]): one panel each, in reading order.
PANELS: tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...] = (
    ("reward", "mean reward of the batch", (("reward/mean", "-", "mean"),)),
    (
        "held-out evals (per version)",
        "mean reward / pass rate",
        (
            ("eval/reverse_text/reward_mean", "-", "reverse_text reward"),
            ("eval/reverse_text/pass_at_k", "--", "reverse_text pass@k"),
            ("eval/fake/reward_mean", ":", "fake reward"),
        ),
    ),
    ("off-policy lag", "steps", (("lag/max", "-", "max"), ("lag/mean", "--", "mean"))),
    ("waste (dropped %)", "% of completed episodes", (("waste/pct", "-", "dropped"),)),
    ("episodes/s", "completed episodes/s", (("throughput/episodes_per_s", "-", "episodes/s"),)),
    ("tokens/s", "sampled tokens/s", (("throughput/tokens_per_s", "-", "tokens/s"),)),
    (
        "buffered and finalizing",
        "episodes / groups",
        (("queue/buffered", "-", "buffered episodes"), ("queue/finalizing", "--", "finalizing groups")),
    ),
    ("trainer loss", "loss", ((TRAINER_PREFIX + "loss", "-", "loss"),)),
    ("mismatch KL", "KL(sampler || trainer)", ((TRAINER_PREFIX + "mismatch_kl", "-", "mismatch KL"),)),
    (
        "loss corrections (trainer.hf.loss)",
        "weight / fraction of tokens / KL",
        (
            (TRAINER_PREFIX + "is_weight_mean", "-", "IS weight mean"),
            (TRAINER_PREFIX + "clipfrac", "--", "clip fraction"),
            (TRAINER_PREFIX + "truncated_frac", ":", "truncated"),
            (TRAINER_PREFIX + "masked_frac", "-.", "masked"),
            (TRAINER_PREFIX + "kl_ref", "-", "KL to the reference"),
        ),
    ),
)
COLUMNS = 2


def series(log: EventLog) -> dict[str, tuple[list[int], list[float]]]:
    """Row name -> (steps, values), ascending by step; a step's last row wins."""
    by_name: dict[str, dict[int, float]] = {}
    for _, _, (step, name, value) in log_rows(log):
        by_name.setdefault(name, {})[step] = value
    return {name: (sorted(points), [points[s] for s in sorted(points)]) for name, points in by_name.items()}


def plot_runs(runs: Sequence[tuple[str, dict[str, tuple[list[int], list[float]]]]], out: Path) -> Figure:
    """Draw `runs` ((label, series) each) into one figure, save it to `out` (PNG) and return it."""
    rows = -(-len(PANELS) // COLUMNS)
    fig = Figure(figsize=(6 * COLUMNS, 3 * rows), layout="constrained")
    axes = fig.subplots(rows, COLUMNS, sharex=True, squeeze=False).flatten()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (title, ylabel, lines) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        drawn = False
        for (label, data), color in zip(runs, colors):
            for name, style, what in lines:
                if name in data:
                    steps, values = data[name]
                    ax.plot(steps, values, style, color=color, marker=".", label=f"{label}: {what}")
                    drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "not in the log", transform=ax.transAxes, ha="center", va="center", color="gray")
        elif len(lines) > 1 or len(runs) > 1:
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    for ax in axes[len(PANELS) :]:
        ax.set_visible(False)
    for ax in axes[-COLUMNS:]:
        ax.set_xlabel("step")
    fig.suptitle(", ".join(label for label, _ in runs))
    fig.savefig(out, dpi=100)
    return fig
