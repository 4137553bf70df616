"""Where a run's figures go beside LOGDIR/metrics.jsonl: TensorBoard's tags for a metrics row
(``row_scalars``), and the experiment trackers that ``logging.track`` (``--track``) names,
which get the resolved config at the start, every metrics row by env steps, and the summary
and the best checkpoint at the end:

- ``wandb``: Weights & Biases, in its offline mode unless a login is set (``WANDB_API_KEY``,
  or ``WANDB_MODE``): the run is written under LOGDIR/wandb and synced later with
  ``wandb sync LOGDIR/wandb/offline-run-*``;
- ``mlflow``: MLflow, to ``MLFLOW_TRACKING_URI`` (MLflow's own default: ``mlflow.db`` and
  ``mlruns/`` in the working directory).

Each is an optional extra (``apex-rl[wandb]``, ``apex-rl[mlflow]``) imported only when named.
A tracker that fails, at its start or on any call, is logged once and dropped: it never stops
the run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal, Protocol

from apex.checkpoint import find
from apex.config import Config, flatten_settings
from apex.errors import ApexError

log = logging.getLogger(__name__)


# TensorBoard groups scalars by the part of the tag before the slash.
_TB_GROUPS = (
    ("return", ("return_mean_100", "train_return_mean_100", "episodes")),
    ("throughput", ("env_steps_per_s", "updates_per_s", "samples_per_s")),
    ("lag", ("policy_lag_mean", "policy_lag_max", "weights_version")),
    ("replay", ("replay_", "queue_", "inserted", "priority_")),
    ("loss", ("loss", "q_mean", "td_abs_mean", "pg_loss", "baseline_loss", "entropy", "grad_norm")),
    ("sections", ("time_",)),  # the learner's ms per step by section (apex.training.pipeline)
)


def tensorboard_tag(key: str) -> str:
    for group, prefixes in _TB_GROUPS:
        if key.startswith(prefixes):
            return f"{group}/{key}"
    return f"system/{key}"


def row_scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's numbers by TensorBoard tag (a multi-agent run's policies' too), as
    TensorBoard and the experiment trackers get them (by env steps)."""
    scalars = {
        tensorboard_tag(key): value
        for key, value in row.items()
        if key not in ("time", "env_steps") and isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    for name, figures in row.get("policies", {}).items():  # a multi-agent run's, by policy
        for key, value in figures.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                scalars[f"policies/{name}/{key}"] = value
    return scalars


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def finish(self, summary: dict[str, Any], best_checkpoint: list[Path]) -> None: ...


class WandbTracker:
    def __init__(self, project: str, run_name: str, config: dict[str, Any], logdir: Path) -> None:
        import wandb

        # WANDB_MODE, if set, is wandb's own to read; else online only with a key
        mode: Literal["online", "offline"] | None = None
        if not os.environ.get("WANDB_MODE"):
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        self.run = wandb.init(project=project, name=run_name, config=config, dir=str(logdir), mode=mode)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log({**scalars, "env_steps": step}, step=step)

    def finish(self, summary: dict[str, Any], best_checkpoint: list[Path]) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, int | float | str | None)})
        if best_checkpoint:
            import wandb

            artifact = wandb.Artifact(f"{self.run.name}-best", type="model")
            for path in best_checkpoint:
                artifact.add_file(str(path))
            self.run.log_artifact(artifact)
        self.run.finish()


class MlflowTracker:
    def __init__(self, project: str, run_name: str, config: dict[str, Any], logdir: Path) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(project)
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params({key: str(value)[:6000] for key, value in flatten_settings(config).items()})  # its cap
        mlflow.set_tag("apex.logdir", str(logdir))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def finish(self, summary: dict[str, Any], best_checkpoint: list[Path]) -> None:
        numbers = {k: float(v) for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        self.mlflow.log_metrics({f"summary/{k}": v for k, v in numbers.items()})
        self.mlflow.set_tag("apex.stop_reason", str(summary.get("stop_reason")))
        for path in best_checkpoint:
            self.mlflow.log_artifact(str(path), artifact_path="best_checkpoint")
        self.mlflow.end_run()


class Trackers:
    """The trackers a run names, each dropped (logged once) at its first failure."""

    def __init__(self, config: Config | None, logdir: Path) -> None:
        """The trackers ``config.logging.track`` names (none for None), the run named after its logdir."""
        self.active: dict[str, Tracker] = {}
        kinds: dict[str, type[WandbTracker] | type[MlflowTracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker}
        if config is None:
            return
        for name in config.logging.track:
            try:
                self.active[name] = kinds[name](config.logging.project, logdir.name, config.to_dict(), logdir)
            except ImportError:
                log.error(
                    "--track %s: %s is not installed (pip install 'apex-rl[%s]'); the run goes on without it",
                    name,
                    name,
                    name,
                )
            except Exception as e:  # a tracker's own failure never stops the run
                log.error("--track %s failed to start (%s: %s); the run goes on without it", name, type(e).__name__, e)

    def log(self, scalars: dict[str, float], step: int) -> None:
        """A metrics row's ``row_scalars``, at ``step`` env steps."""
        for name in list(self.active):
            self._call(name, "log", scalars, step)

    def finish(self, summary: dict[str, Any], logdir: Path) -> None:
        """The summary, and the run's best checkpoint (its manifest and state) as an artifact."""
        files = best_checkpoint_files(logdir) if self.active else []
        for name in list(self.active):
            self._call(name, "finish", summary, files)
        self.active.clear()

    def _call(self, name: str, method: str, *args: Any) -> None:
        try:
            getattr(self.active[name], method)(*args)
        except Exception as e:  # logged once: the tracker is dropped
            del self.active[name]
            log.error("--track %s failed (%s: %s); the run goes on without it", name, type(e).__name__, e)


def best_checkpoint_files(logdir: Path) -> list[Path]:
    """The best checkpoint's manifest and learner state (not its replay: gigabytes), or none."""
    try:
        best = find(logdir, "best")
    except ApexError:
        return []
    return [best.manifest_path, best.state_path]


__all__ = ["Trackers", "row_scalars", "tensorboard_tag"]
