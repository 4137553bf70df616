"""`apex plot LOGDIR... -o FILE.png`: learning curves and throughput of one or more runs,
from their metrics.jsonl, each run named by its env and algorithm."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apex.checkpoint.common import MAX_MANIFEST_BYTES, memory_bytes
from apex.config import Config
from apex.config.loading import parse_yaml
from apex.errors import ApexError
from apex.system.files import open_regular, read_regular

if TYPE_CHECKING:  # matplotlib is imported only to draw (the plot extra)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.typing import ColorType

_MAX_TICKS = 6  # a 5-inch axis holds this many "1.25M"-wide labels with room between them
_PLOTTED = ("time", "env_steps", "env_steps_per_s")  # what every row must have (return_mean_100 may be null)

log = logging.getLogger("apex.run.plot")


def read_metrics(logdir: str | Path) -> list[dict[str, Any]]:
    path = Path(logdir) / "metrics.jsonl"
    try:  # a regular file only (RefusedFile says what else it is): a FIFO blocked, /dev/zero filled memory
        metrics = open_regular(path, memory_bytes() // 4)
    except FileNotFoundError:
        raise ApexError(f"{path} not found: pass a run's --logdir directory") from None
    except OSError as e:
        raise ApexError(f"cannot read {path}: {e.strerror}") from None
    rows, skipped = [], 0
    with metrics:
        lines = metrics.read().decode("utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # ValueError: JSONDecodeError, or an integer past int()'s digits
            raise ApexError(f"{path}:{number} is not JSON: is this an apex metrics file?") from None
        if _plottable(row):
            rows.append(row)
        else:
            skipped += 1
    if skipped:
        log.warning(
            "%s: skipped %d of %d rows: each must be a JSON object whose %s (and return_mean_100, "
            "or null) are finite numbers",
            path,
            skipped,
            skipped + len(rows),
            ", ".join(_PLOTTED),
        )
    if not rows:
        raise ApexError(f"{path} holds no metrics yet" if not skipped else f"{path} holds no row to plot")
    return surviving_timeline(rows)


def _finite(value: Any) -> bool:
    """A number that a curve can hold: JSON reads NaN, Infinity and 1e400 (inf) too."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past any float
        return False


def _plottable(row: Any) -> bool:
    return (
        isinstance(row, dict)
        and all(_finite(row.get(key)) for key in _PLOTTED)
        and (row.get("return_mean_100") is None or _finite(row["return_mean_100"]))
    )


def surviving_timeline(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the run as it went on: a learner resumed from a checkpoint continues the
    run's clock from there, so the rows its killed predecessor wrote after that checkpoint
    (same or later times) belong to a history that was rolled back, and are dropped."""
    kept: list[dict[str, Any]] = []
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


def run_labels(logdirs: list[str]) -> list[str]:
    """Each run's env and algorithm ("CartPole-v1 apex_dqn"), from LOGDIR/config.yaml or the
    config in its newest checkpoint manifest; with its directory too where several runs share
    env and algorithm, and the directory alone where neither config can be read."""
    directories = _labels(logdirs)
    kinds = [_env_and_algo(Path(d)) for d in logdirs]
    shared = Counter(kinds)
    return [
        directory if kind is None else " ".join(kind) + (f" ({directory})" if shared[kind] > 1 else "")
        for directory, kind in zip(directories, kinds)
    ]


def _env_and_algo(logdir: Path) -> tuple[str, str] | None:
    config = _run_config(logdir)
    if config is None:
        return None
    default = Config()  # what a config that leaves them out means
    env = config.get("env")
    env_id = env.get("id", default.env.id) if isinstance(env, dict) else default.env.id
    algo = config.get("algo", default.algo)
    return str(env_id), str(algo)


def _run_config(logdir: Path) -> dict[str, Any] | None:
    """The run's config as a dict, or None: a plot is still worth drawing without it. Read
    as any file of a run from elsewhere: regular files of bounded size, YAML aliases bounded."""
    try:
        config = parse_yaml(read_regular(logdir / "config.yaml", MAX_MANIFEST_BYTES).decode(), "config.yaml")
        if isinstance(config, dict):
            return config
    except (OSError, ValueError, ApexError):  # RefusedFile and ConfigError are ApexErrors
        pass
    # `apex learner` alone writes no config.yaml; its checkpoints hold the config.
    for manifest in sorted((logdir / "checkpoints").glob("ckpt-*.json"), reverse=True):
        try:
            config = json.loads(read_regular(manifest, MAX_MANIFEST_BYTES)).get("config")
        except (OSError, ValueError, AttributeError, ApexError):
            continue
        if isinstance(config, dict):
            return config
    return None


def smoothed(values: list[float], weight: float | None) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average with ``weight`` in [0, 1) (the
    share of the previous average kept at each row), debiased so that the curve starts at
    the first value rather than at 0. 0 or None: the values as they are."""
    if not weight:
        return list(values)
    out, average = [], 0.0
    for n, value in enumerate(values, 1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**n))
    return out


def si(value: float, _position: Any = None) -> str:
    """A tick label short enough to stay apart from its neighbours: 250k, 1.25M, 2B."""
    text = f"{value:.3g}"
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale * 0.9995:  # 999.6k rounds to 1M, not 1e+03k
            text = f"{value / scale:.3g}{unit}"
            break
    return text.replace("-", "\N{MINUS SIGN}")  # as matplotlib's own labels


def _time_unit(seconds: float) -> tuple[float, str]:
    """The unit that keeps a run's wall-time ticks short: seconds, minutes or hours."""
    if seconds > 2 * 3600:
        return 3600.0, "hours"
    if seconds > 120:
        return 60.0, "minutes"
    return 1.0, "seconds"


def figure(logdirs: list[str], smooth: float | None = 0) -> Figure:
    """The matplotlib Figure ``plot`` saves (see there); the caller closes it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, MaxNLocator
    except ImportError:
        raise ApexError("apex plot needs matplotlib: pip install 'apex-rl[plot]'") from None
    if smooth is not None and not 0 <= smooth < 1:
        raise ApexError(f"--smooth must be in [0, 1) (an EMA weight, as in TensorBoard; 0: off), got {smooth}")
    runs = {label: read_metrics(d) for label, d in zip(run_labels(logdirs), logdirs)}
    scale, unit = _time_unit(max(row["time"] for rows in runs.values() for row in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, rows in runs.items():
        scored = [r for r in rows if r.get("return_mean_100") is not None]
        returns = [r["return_mean_100"] for r in scored]
        color = _curve(axes[0], [r["env_steps"] for r in scored], returns, label, smooth)
        _curve(axes[1], [r["time"] / scale for r in scored], returns, label, smooth, color)
        _curve(axes[2], [r["time"] / scale for r in rows], [r["env_steps_per_s"] for r in rows], label, smooth, color)
    axes[0].set(xlabel="env steps", ylabel="return_mean_100", title="return vs env steps")
    axes[1].set(xlabel=unit, ylabel="return_mean_100", title="return vs wall time")
    axes[2].set(xlabel=unit, ylabel="env steps/s", title="throughput")
    for axis in (axes[0].xaxis, axes[2].yaxis):  # counts: 1.2M, not 1200000 (or 1e6 in a corner)
        axis.set_major_formatter(FuncFormatter(si))
    for axis in axes:
        axis.xaxis.set_major_locator(MaxNLocator(nbins=_MAX_TICKS))
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize="small")  # one legend: the colours are the same in all three
    fig.tight_layout()
    return fig


def _curve(
    axis: Axes, x: list[float], y: list[float], label: str, smooth: float | None, color: ColorType | None = None
) -> ColorType:
    """Draws y against x (smoothed, over the raw curve drawn faint); returns its colour."""
    if smooth:
        color = axis.plot(x, y, color=color, alpha=0.25, linewidth=1)[0].get_color()
    return axis.plot(x, smoothed(y, smooth), color=color, label=label)[0].get_color()


def plot(logdirs: list[str], output: str, smooth: float | None = 0) -> Path:
    """Draws return_mean_100 against env steps and wall time, and env steps/s over time, one
    curve per run, named by env and algorithm (see ``run_labels``). ``smooth``: an EMA
    weight in [0, 1) as in TensorBoard (0.6 is its default, 0.9 smooths a lot; 0 or None:
    off), applied row by row of metrics.jsonl; the raw curve stays, faint, behind."""
    fig = figure(logdirs, smooth)  # ApexError first if matplotlib is missing
    import matplotlib.pyplot as plt

    try:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
