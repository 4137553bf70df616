"""Run output: metrics.jsonl lines, TensorBoard scalars, the console status line, summary.json,
episode stats."""

from __future__ import annotations

import json
import logging
import math
import os
import reprlib
import shlex
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from apex.checkpoint import RunCheckpoints, best_and_newest
from apex.errors import ApexError
from apex.learner.tracking import Trackers, row_scalars
from apex.system.files import open_append, refuse_link, remove_stale_temps, write_atomic
from apex.system.logs import RateLimitedLog
from apex.wire.schema import possible_return

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)


class EpisodeStats:
    """Returns of the last 100 evaluation and the last 100 training episodes."""

    def __init__(self, window: int = 100) -> None:
        self.window = window
        self.eval_returns: deque[float] = deque(maxlen=window)
        self.train_returns: deque[float] = deque(maxlen=window)
        self.episodes = 0
        self.best_return_mean = -math.inf

    def add(self, episode_return: float, is_eval: bool) -> None:
        self.episodes += 1
        self.train_returns.append(float(episode_return))
        if is_eval:
            self.eval_returns.append(float(episode_return))
            if len(self.eval_returns) == self.window and (mean := self.return_mean) is not None:
                self.best_return_mean = max(self.best_return_mean, mean)

    def state_dict(self) -> dict[str, Any]:
        return {
            "eval": list(self.eval_returns),
            "train": list(self.train_returns),
            "episodes": self.episodes,
            "best": self.best_return_mean,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.eval_returns.extend(state["eval"])
        self.train_returns.extend(state["train"])
        self.episodes = state["episodes"]
        self.best_return_mean = state["best"]

    @staticmethod
    def problem(state: dict[str, Any], step_limit: int, max_abs_reward: float) -> str | None:
        """Why ``state`` (a checkpoint's ``state_dict()``, its types checked) cannot be a run's
        whose episodes last at most ``step_limit`` steps, or None: every return, and the best
        mean, must be one an actor's episode record could bring (schema.possible_return)."""
        returns = [*(("eval", r) for r in state["eval"]), *(("train", r) for r in state["train"])]
        if state["best"] != -math.inf:  # no full window yet
            returns.append(("best", state["best"]))
        for key, value in returns:
            if not possible_return(value, step_limit, max_abs_reward):
                return (
                    f"episode_stats.{key} holds a return of {reprlib.repr(value)}, which no episode of at most "
                    f"{step_limit} steps of at most transport.max_abs_reward ({max_abs_reward:g}) can have"
                )
        return None

    @property
    def return_mean(self) -> float | None:
        """Mean of the last 100 evaluation episodes (of those so far, before there are 100)."""
        return sum(self.eval_returns) / len(self.eval_returns) if self.eval_returns else None

    @property
    def full_window(self) -> bool:
        return len(self.eval_returns) == self.window

    @property
    def train_return_mean(self) -> float | None:
        return sum(self.train_returns) / len(self.train_returns) if self.train_returns else None


PROGRESS_INTERVAL_S = 30.0  # a plain progress line this often when the console is not a terminal


class MetricsWriter:
    """Appends one JSON object per call to LOGDIR/metrics.jsonl, writes the numbers as
    TensorBoard scalars to LOGDIR/tb (by env steps), and keeps a status line on the console
    when it is a terminal; when it is not (a batch job, nohup, a container's log), it prints
    the same line as plain text every ``progress_interval_s``.

    A full disk or any other write error does not end the run: ``write`` and ``close`` log
    it (rate-limited), count it in ``write_failures`` and go on. The metrics file is retried
    on every later write (a disk may free up) and a failed line is cut off again, so the file
    holds whole lines only; TensorBoard is turned off for the rest of the run after its first
    failure (its writer thread dies with it). A link planted at LOGDIR/metrics.jsonl or
    LOGDIR/tb is refused (ApexError), never written through."""

    def __init__(
        self,
        logdir: Path,
        console: TextIO | None = None,
        tensorboard: bool = True,
        progress_interval_s: float = PROGRESS_INTERVAL_S,
        trackers: Trackers | None = None,
    ) -> None:
        logdir = Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(logdir)  # e.g. summary.json's, left by a learner killed while writing it
        if tensorboard:
            refuse_link(logdir / "tb")
        self.trackers = trackers  # logging.track's: every row goes to them too
        self.path = logdir / "metrics.jsonl"
        try:
            self._fd: int | None = open_append(self.path)
        except OSError as e:
            raise ApexError(f"cannot append to {self.path}: {e.strerror}; check --logdir's permissions") from None
        self._console = console if console is not None else sys.stderr
        self._tty = self._console.isatty()
        self._progress_interval_s = progress_interval_s
        self._progress_slot: int | None = None  # run time // progress_interval_s of the last plain progress line
        self.write_failures = 0  # failed writes of metrics.jsonl and TensorBoard, since the start
        self._failed = RateLimitedLog(log, interval_s=5.0)  # a full disk fails every write
        self._file_failing = False
        self._cut_to: int | None = None  # the file's size before a line that failed half way
        self._tb: SummaryWriter | None = None
        if tensorboard:
            self._tb = self._open_tensorboard(logdir / "tb")

    def _open_tensorboard(self, directory: Path) -> SummaryWriter | None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: not at start-up

        _quiet_tensorboard_thread_errors()
        try:
            return SummaryWriter(str(directory), flush_secs=10)
        except OSError as e:
            self._tensorboard_failed(e)
            return None

    def write(self, row: dict[str, Any]) -> None:
        self._append((json.dumps(row) + "\n").encode())
        trackers = self.trackers if self.trackers is not None and self.trackers.active else None
        if self._tb is not None or trackers is not None:
            scalars = row_scalars(row)  # once, for TensorBoard and the trackers alike
            self._add_scalars(scalars, row["env_steps"])
            if trackers is not None:
                trackers.log(scalars, row["env_steps"])
        if self._tty:
            self._status(row)
        elif (slot := int(row.get("time", 0) // self._progress_interval_s)) != self._progress_slot:
            self._progress_slot = slot  # the first row, then the first of every interval of run time
            self._progress(row)

    def _append(self, line: bytes) -> None:
        fd = self._fd
        if fd is None:
            raise ValueError(f"{self.path} was closed: no more rows")
        try:
            self._cut_partial_line(fd)
            self._cut_to = os.fstat(fd).st_size
            _write_all(fd, line)
            self._cut_to = None
        except OSError as e:
            try:
                self._cut_partial_line(fd)
            except OSError:
                pass  # cut before the next line instead
            self.write_failures += 1
            self._file_failing = True
            self._failed.warning("writing %s failed: %s; the run goes on and retries", self.path, e.strerror or e)
            return
        if self._file_failing:
            self._file_failing = False
            log.info("%s is written again", self.path)

    def _cut_partial_line(self, fd: int) -> None:
        """Removes what a failed write left of its line: readers (apex plot) parse every line."""
        if self._cut_to is not None:
            os.ftruncate(fd, self._cut_to)
            self._cut_to = None

    def _add_scalars(self, scalars: dict[str, float], step: int) -> None:
        tb = self._tb
        if tb is None:
            return
        try:
            for tag, value in scalars.items():
                tb.add_scalar(tag, value, step, walltime=None)
        except OSError as e:  # raised by its writer thread on a later call
            self._tensorboard_failed(e)

    def _tensorboard_failed(self, error: OSError) -> None:
        self.write_failures += 1
        log.warning(
            "writing TensorBoard scalars failed: %s; TensorBoard output is off for the rest of the run "
            "(metrics.jsonl has the same numbers)",
            error.strerror or error,
        )
        tb, self._tb = self._tb, None
        if tb is not None:
            try:
                tb.close()
            except OSError:
                pass  # the same error again: already counted and said

    def _status(self, row: dict[str, Any]) -> None:
        try:
            # Cut to the terminal's width: a wrapped line would not be redrawn in place.
            width = shutil.get_terminal_size().columns - 1
            self._console.write("\r" + status_line(row)[:width] + "\033[K")
            self._console.flush()
        except OSError:  # a terminal gone away: the files have it all
            self._tty = False

    def _progress(self, row: dict[str, Any]) -> None:
        try:
            self._console.write(status_line(row) + "\n")
            self._console.flush()
        except (OSError, ValueError):  # a closed pipe (the reader went away): the files have it all
            self._progress_interval_s = float("inf")

    def close(self) -> None:
        if self._tty:
            try:
                self._console.write("\n")
            except OSError:
                pass
        if self._tb is not None:
            try:
                self._tb.close()  # flushes: the first moment a failure of its thread shows
            except OSError as e:
                self._tensorboard_failed(e)
            self._tb = None
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError as e:  # e.g. EIO from a network file system: the lines are what they are
                self.write_failures += 1
                self._failed.warning("closing %s failed: %s; its last lines may be missing", self.path, e.strerror or e)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _quiet_tensorboard_thread_errors() -> None:
    """TensorBoard's writer thread dies with a traceback on stderr when a write fails, then
    raises the error again on the next call; there it is logged in one line and counted.
    Silences the traceback (an OSError in that thread) only; anything else goes to the
    previous hook."""
    previous = threading.excepthook
    if getattr(previous, "apex_quiet_tensorboard", False):
        return
    threading.excepthook = _QuietTensorboardHook(previous)


class _QuietTensorboardHook:
    """``_quiet_tensorboard_thread_errors``' threading.excepthook (installed once: its mark)."""

    apex_quiet_tensorboard = True

    def __init__(self, previous: Callable[[threading.ExceptHookArgs], object]) -> None:
        self.previous = previous

    def __call__(self, args: threading.ExceptHookArgs) -> None:
        if not (issubclass(args.exc_type, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            self.previous(args)


def status_line(row: dict[str, Any]) -> str:
    """One line that says what its numbers are: run time, env steps and rate, updates and
    rate, the evaluation return and over how many episodes, replay fill and the replay ratio
    achieved against the one set, actors, and the
    policy lag (how many updates behind the learner the actors' weights were)."""
    ret, lag = row.get("return_mean_100"), row.get("policy_lag_mean")
    episodes = row.get("eval_episodes_in_window")
    over = f" over {episodes} ep" if episodes else ""
    capacity = row.get("replay_capacity")
    replay = ""
    if "replay_size" in row:
        fill = f" ({100 * row['replay_size'] / capacity:3.0f}%)" if capacity else ""
        replay = f"  replay {row['replay_size']:>9,}{fill}"
        if (ratio := row.get("replay_ratio")) is not None:
            replay += f" ratio {ratio:.2f} of {row.get('replay_ratio_target', 0):g}"

    def get(key: str) -> Any:  # 0 for what a row does not hold (yet)
        return row.get(key) or 0

    policies = "".join(
        f"  {name} {'-' if (r := figures.get('return_mean_100')) is None else f'{r:.2f}'}"
        for name, figures in row.get("policies", {}).items()
    )
    return (
        f"[{get('time'):7.1f}s] env steps {get('env_steps'):>10,} ({get('env_steps_per_s'):>8,.0f}/s)  "
        f"updates {get('learner_updates'):>8,} ({get('updates_per_s'):>6,.0f}/s)  "
        f"eval return {'-' if ret is None else f'{ret:7.1f}'}{over}{replay}  "
        f"actors {get('actors_connected')}  policy lag {'-' if lag is None else f'{lag:.0f} updates'}{policies}"
    )


def closing_line(summary: dict[str, Any], checkpoints: Any, resume_command: str) -> str:
    """The learner's last word: why it stopped, how far it got, the returns, where the best
    and the newest checkpoints are (``checkpoint.RunCheckpoints``) and how to go on."""

    def ret(value: Any) -> str:
        return "-" if value is None else f"{value:.1f}"

    best, best_score, newest = checkpoints
    if newest is None:
        where = "no checkpoint"
    elif best is None:
        where = f"newest checkpoint {shlex.quote(str(newest))} (none scored yet: 100 evaluation episodes are needed)"
    elif best == newest:
        where = f"best checkpoint {shlex.quote(str(best))} (return_mean_100 {ret(best_score)}; also the newest)"
    else:
        where = (
            f"best checkpoint {shlex.quote(str(best))} (return_mean_100 {ret(best_score)}), "
            f"newest {shlex.quote(str(newest))}"
        )
    return (
        f"stopped ({summary['stop_reason']}) after {summary['wall_seconds']:.1f}s: {summary['env_steps']:,} env steps, "
        f"{summary['learner_updates']:,} updates; eval return {ret(summary['return_mean_100'])} "
        f"(best seen {ret(summary.get('best_return_mean_100'))}); {where}; resume with: {resume_command}"
    )


def say_goodbye(logdir: Path, summary: dict[str, Any], resume_command: str) -> None:
    """Logs the closing line: why the run stopped, its returns, its checkpoints, how to go on."""
    try:
        checkpoints = best_and_newest(logdir)
    except OSError:
        checkpoints = RunCheckpoints(None, None, None)
    logging.getLogger("apex.learner.process").info("%s", closing_line(summary, checkpoints, resume_command))


def write_summary(logdir: Path, summary: dict[str, Any]) -> None:
    """LOGDIR/summary.json; a full disk is logged, and the run's end all the same."""
    try:
        write_json_atomic(logdir / "summary.json", summary)
    except OSError as e:
        log.error("could not write %s: %s", logdir / "summary.json", e)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Writes ``data`` as JSON to ``path`` whole or not at all (see apex.system.files.write_atomic);
    raises OSError if it cannot, leaving ``path`` as it was and no temporary file."""
    text = json.dumps(data, indent=2) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))


class Rate:
    """Events per second between successive reads."""

    def __init__(self, count: int = 0) -> None:
        self._last_time = time.monotonic()
        self._last_count = count

    def __call__(self, count: int) -> float:
        now = time.monotonic()
        rate = (count - self._last_count) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_count = now, count
        return rate
