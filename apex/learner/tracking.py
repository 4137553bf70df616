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
import queue
import re
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import urlparse

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
        for variable, sub in _WANDB_DIRS.items():  # its caches under the run, not ~/.cache
            os.environ.setdefault(variable, str(logdir / "wandb" / sub))
        os.environ.setdefault("WANDB_INIT_TIMEOUT", str(int(START_DEADLINE_S)))
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

            artifact = wandb.Artifact(artifact_name(self.run.name), type="model")
            for path in best_checkpoint:
                artifact.add_file(str(path))
            self.run.log_artifact(artifact)
        self.run.finish()


def artifact_name(run_name: str) -> str:
    """The best checkpoint's W&B artifact name: the run's, in the characters and length W&B
    allows (a LOGDIR named "my run" made ``wandb.Artifact`` raise, and the run never finished)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run_name)[: MAX_RUN_NAME - len("-best")] + "-best"


class MlflowTracker:
    def __init__(self, project: str, run_name: str, config: dict[str, Any], logdir: Path) -> None:
        # MLflow's defaults (120 s a request, 7 retries with backoff) hold a call for many
        # minutes; these give up within CALL_DEADLINE_S, where the tracker is dropped anyway.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)  # its retries: ours is the warning
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


# A tracker runs on a thread of its own, behind a bounded queue: a tracker that hangs (a
# server that accepts and never answers) or is slow costs the learner nothing but the rows
# it is sent. One that has not started within START_DEADLINE_S, whose call has run longer
# than CALL_DEADLINE_S, or whose queue is full is dropped with one warning.
QUEUE_ROWS = 256
START_DEADLINE_S = 30.0
CALL_DEADLINE_S = 30.0
FINISH_DEADLINE_S = 30.0  # for the summary and the best checkpoint, all trackers together
MAX_RUN_NAME = 128  # the run's name at a tracker: LOGDIR's last part, cut


class _TrackerThread:
    """One tracker, started and called on a daemon thread, in the order of its queue."""

    def __init__(self, name: str, start: Callable[[], Tracker]) -> None:
        self.name = name
        self.queue: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue(maxsize=QUEUE_ROWS)
        self.failed: str | None = None  # why it stopped, once it has
        self.busy_since: float | None = time.monotonic()  # its start, then each call under way
        self.started = False
        self.done = threading.Event()
        self._start = start
        self.thread = threading.Thread(target=self._work, name=f"apex-track-{name}", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            tracker = self._start()
        except ImportError:
            self.failed = f"cannot start: {self.name} is not installed (pip install 'apex-rl[{self.name}]')"
            self.done.set()
            return
        except Exception as e:  # a tracker's own failure never stops the run
            self.failed = f"failed to start ({type(e).__name__}: {str(e)[:400]})"
            self.done.set()
            return
        self.started, self.busy_since = True, None
        while (item := self.queue.get()) is not None:
            method, args = item
            self.busy_since = time.monotonic()
            try:
                getattr(tracker, method)(*args)
            except Exception as e:
                self.failed = f"failed ({type(e).__name__}: {str(e)[:400]})"
                break
            self.busy_since = None
        self.done.set()

    def hung(self, now: float) -> str | None:
        """Why it counts as hung (past a deadline), or None."""
        since = self.busy_since
        if since is None:
            return None
        limit, what = (CALL_DEADLINE_S, "a call") if self.started else (START_DEADLINE_S, "its start")
        if now - since > limit:
            return f"{what} has had no answer for {now - since:.0f} s (over {limit:.0f} s)"
        return None


class Trackers:
    """The trackers a run names, each on a thread of its own and dropped (logged once) at its
    first failure, when it hangs past a deadline, or when it falls QUEUE_ROWS rows behind."""

    def __init__(self, config: Config | None, logdir: Path) -> None:
        """The trackers ``config.logging.track`` names (none for None), the run named after its logdir."""
        self.active: dict[str, _TrackerThread] = {}
        if config is None:
            return
        kinds: dict[str, type[WandbTracker] | type[MlflowTracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker}
        settings = config.to_dict()
        for name in config.logging.track:
            refused = _outside_the_run(name, logdir)
            if refused:
                log.warning("--track %s: %s; the run goes on without it", name, refused)
                continue
            start = partial(kinds[name], config.logging.project, logdir.name[:MAX_RUN_NAME], settings, logdir)
            self.active[name] = _TrackerThread(name, start)

    def log(self, scalars: dict[str, float], step: int) -> None:
        """A metrics row's ``row_scalars``, at ``step`` env steps (queued: it never waits)."""
        self._drop_the_failed()
        for name, worker in list(self.active.items()):
            try:
                worker.queue.put_nowait(("log", (scalars, step)))
            except queue.Full:
                self._drop(name, f"is {QUEUE_ROWS} rows behind (slow or hung)")

    def finish(self, summary: dict[str, Any], logdir: Path) -> None:
        """The summary, and the run's best checkpoint (its manifest and state) as an artifact;
        waits for them at most FINISH_DEADLINE_S (for all trackers together)."""
        self._drop_the_failed()
        files = best_checkpoint_files(logdir) if self.active else []
        for name, worker in list(self.active.items()):
            try:
                worker.queue.put_nowait(("finish", (summary, files)))
                worker.queue.put_nowait(None)
            except queue.Full:
                self._drop(name, f"is {QUEUE_ROWS} rows behind (slow or hung)")
        deadline = time.monotonic() + FINISH_DEADLINE_S
        for name, worker in list(self.active.items()):
            if not worker.done.wait(max(0.0, deadline - time.monotonic())):
                self._drop(name, f"did not finish within {FINISH_DEADLINE_S:.0f} s (its summary may be missing)")
        self._drop_the_failed()
        self.active.clear()

    def _drop_the_failed(self) -> None:
        now = time.monotonic()
        for name, worker in list(self.active.items()):
            if worker.failed is not None:
                self._drop(name, worker.failed)
            elif (why := worker.hung(now)) is not None:
                self._drop(name, why)

    def _drop(self, name: str, why: str) -> None:
        """Logged once: its thread is left to end (a daemon: it never holds the process)."""
        del self.active[name]
        log.error("--track %s %s; dropped: the run goes on without it", name, why)


# W&B's directories that a run writes: under the run unless the environment names them.
_WANDB_DIRS = {"WANDB_CACHE_DIR": "cache", "WANDB_DATA_DIR": "data", "WANDB_ARTIFACT_DIR": "artifacts"}


def _outside_the_run(name: str, logdir: Path) -> str | None:
    """Why tracker ``name`` would write outside the run (LOGDIR, or the working directory:
    MLflow's own default store), or None. A remote MLflow server (http, https, a database
    server) is not a place on this disk and is not refused here."""
    places = [Path.cwd().resolve(), logdir.resolve()]

    def outside(path: str) -> bool:
        where = Path(path).expanduser()
        where = (where if where.is_absolute() else Path.cwd() / where).resolve()
        return not any(where == p or where.is_relative_to(p) for p in places)

    if name == "mlflow":
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        parsed = urlparse(uri)
        # SQLAlchemy's sqlite:///relative.db, sqlite:////absolute.db
        path = {"": uri, "file": parsed.path, "sqlite": parsed.path[1:]}.get(parsed.scheme)
        if path and outside(path):
            return (
                f"MLFLOW_TRACKING_URI {uri!r} is a local store outside the run (LOGDIR or the working "
                "directory); set it to a path under either, or to a tracking server's http(s) URL"
            )
    elif name == "wandb":
        for variable in ("WANDB_DIR", *_WANDB_DIRS):
            if (path := os.environ.get(variable)) and outside(path):
                return f"{variable} {path!r} is outside the run (LOGDIR or the working directory); unset it"
    return None


def best_checkpoint_files(logdir: Path) -> list[Path]:
    """The best checkpoint's manifest and learner state (not its replay: gigabytes), or none."""
    try:
        best = find(logdir, "best")
    except ApexError:
        return []
    return [best.manifest_path, best.state_path]


__all__ = ["Trackers", "row_scalars", "tensorboard_tag"]
