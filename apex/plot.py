"""`apex plot LOGDIR... -o FILE.png`: learning curves and throughput of one or more runs,
from their metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from apex.errors import ApexError


def read_metrics(logdir: str | Path) -> list[dict]:
    path = Path(logdir) / "metrics.jsonl"
    if not path.is_file():
        raise ApexError(f"{path} not found: pass a run's --logdir directory")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise ApexError(f"{path}:{number} is not JSON: is this an apex metrics file?") from None
    if not rows:
        raise ApexError(f"{path} holds no metrics yet")
    return surviving_timeline(rows)


def surviving_timeline(rows: list[dict]) -> list[dict]:
    """The rows of the run as it went on: a learner resumed from a checkpoint continues the
    run's clock from there, so the rows its killed predecessor wrote after that checkpoint
    (same or later times) belong to a history that was rolled back, and are dropped."""
    kept: list[dict] = []
    for row in rows:
        while kept and kept[-1]["time"] >= row["time"]:
            kept.pop()
        kept.append(row)
    return kept


def _labels(logdirs: list[str]) -> list[str]:
    """Run directory names, with their parents where the names alone are not unique."""
    paths = [Path(d).resolve() for d in logdirs]
    for depth in range(1, 4):
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def plot(logdirs: list[str], output: str) -> Path:
    """Draws return_mean_100 against env steps and wall time, and env steps/s over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ApexError("apex plot needs matplotlib: pip install 'apex-rl[plot]'") from None
    runs = {label: read_metrics(d) for label, d in zip(_labels(logdirs), logdirs)}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, rows in runs.items():
        scored = [r for r in rows if r.get("return_mean_100") is not None]
        axes[0].plot([r["env_steps"] for r in scored], [r["return_mean_100"] for r in scored], label=label)
        axes[1].plot([r["time"] for r in scored], [r["return_mean_100"] for r in scored], label=label)
        axes[2].plot([r["time"] for r in rows], [r["env_steps_per_s"] for r in rows], label=label)
    axes[0].set(xlabel="env steps", ylabel="return_mean_100", title="return vs env steps")
    axes[1].set(xlabel="seconds", ylabel="return_mean_100", title="return vs wall time")
    axes[2].set(xlabel="seconds", ylabel="env steps/s", title="throughput")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    fig.tight_layout()
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
