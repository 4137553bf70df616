"""`apex run --ray ADDRESS`: the learner and the actors as Ray actors on a Ray cluster, each
running its apex process (``python -m apex learner|actor``) as a child, talking over apex's own
ZeroMQ ports exactly as processes do, with CURVE keys made for the run (the learner binds every
interface of its node). Ray places them (the learner with its device's resources, the actors
spread over the nodes, ``--ray-actor-cpus`` each) and restarts an actor that dies, which then
joins the learner again; a learner that dies is started again from its newest checkpoint
(``--auto-resume``), as `apex run` does. When the learner stops (a stop condition, or Ctrl-C
here: it writes its checkpoint first) every Ray actor of the run stops its process, removes its
files (the CURVE keys among them) and is killed: nothing is left on the cluster. The run
directory is on the learner's node.

``ray`` (the ``ray`` extra) is imported only here, only with ``--ray``.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from apex.config import Config, StopConditions
from apex.errors import ApexError
from apex.run.launch import _ACTOR_RESTART_FIRST_S, _RESTART_MAX_S, stop_args
from apex.run.node_files import NodeFiles
from apex.system.signals import StopSignals
from apex.transport.keys import generate_keys

log = logging.getLogger(__name__)

FILES = "{files}"  # in an argument: the directory the process's files were written to, on its node
POLL_S = 0.5
CLOSE_WAIT_S = 10.0  # for a process to stop on SIGTERM at teardown, before SIGKILL
NAMESPACE_PREFIX = "apex-"
ACTOR_FILES_ARGS = ("--config", f"{FILES}/config.yaml", "--curve-dir", f"{FILES}/keys")


def _die_with_parent() -> None:  # the apex process goes with the Ray actor that runs it (between fork and exec)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ApexProcess:
    """A Ray actor that runs one apex process: ``run`` starts it with its files (the config,
    CURVE keys) written on this node and returns its exit code; ``stop`` sends it SIGTERM;
    ``close`` stops it and removes its files."""

    def __init__(self, files: dict[str, bytes], name: str) -> None:
        self.files = NodeFiles(files, name)  # the name holds the run's random id and the role
        self.process: subprocess.Popen[bytes] | None = None

    def host(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def run(self, argv: list[str]) -> int:
        directory = str(self.files.write())
        command = [sys.executable, "-m", "apex", *(a.replace(FILES, directory) for a in argv)]
        try:
            self.process = subprocess.Popen(command, preexec_fn=_die_with_parent)
            return self.process.wait()
        finally:
            self.files.remove()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def close(self) -> None:
        """Stops the process (SIGKILL after CLOSE_WAIT_S) and removes the files."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.files.close()


def run_on_ray(
    address: str,
    config: Config,
    actors: int,
    logdir: Path,
    stop: StopConditions,
    port: int,
    *,
    actor_cpus: float = 1.0,
    learner_restarts: int = 10,
) -> int:
    """Runs the learner and ``actors`` actors on the Ray cluster at ``address`` ("auto": the
    one ``ray.init`` finds) until the learner exits for good; returns its exit code."""
    try:
        import ray
    except ImportError:
        raise ApexError("--ray needs Ray: pip install 'apex-rl[ray]'") from None
    try:
        run_id = uuid.uuid4().hex
        ray.init(address=address, namespace=f"{NAMESPACE_PREFIX}{run_id[:8]}", log_to_driver=True)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise ApexError(f"--ray {address}: no Ray cluster there ({e}); start one with `ray start --head`") from None
    remote = ray.remote(ApexProcess)
    with tempfile.TemporaryDirectory(prefix="apex-ray-keys-") as keys:
        generate_keys(keys)
        key = Path(keys)
        config_yaml = yaml.safe_dump(config.to_dict(), sort_keys=False).encode()  # as Config.save writes it
        learner_files = {
            "config.yaml": config_yaml,
            "keys/learner.key_secret": (key / "learner.key_secret").read_bytes(),
            "keys/learner.key": (key / "learner.key").read_bytes(),
            "keys/authorized/actor.key": (key / "authorized" / "actor.key").read_bytes(),
        }
        actor_files = {
            "config.yaml": config_yaml,
            "keys/learner.key": (key / "learner.key").read_bytes(),
            "keys/actor.key_secret": (key / "actor.key_secret").read_bytes(),
        }
    cuda = config.learner.device.startswith("cuda") or (
        config.learner.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
    )
    learner = remote.options(
        name="apex-learner", num_cpus=1, num_gpus=1 if cuda else 0, max_concurrency=2, max_restarts=0
    ).remote(learner_files, f"apex-ray-{run_id}-learner")
    host = ray.get(learner.host.remote())
    learner_argv = [
        "learner",
        *("--config", f"{FILES}/config.yaml", "--logdir", str(logdir), "--curve-dir", f"{FILES}/keys"),
        *("--bind-host", "0.0.0.0", "--port", str(port), "--auto-resume", *stop_args(stop)),
    ]
    handles = [
        remote.options(
            name=f"apex-actor-{i}",
            num_cpus=actor_cpus,
            max_restarts=-1,
            max_task_retries=0,  # _ActorRuns starts the process again: one start, one process
            max_concurrency=2,
            scheduling_strategy="SPREAD",
        ).remote(actor_files, f"apex-ray-{run_id}-actor-{i}")
        for i in range(actors)
    ]
    actor_argv = [
        ["actor", "--learner", f"{host}:{port}", "--actor-index", str(i), *ACTOR_FILES_ARGS] for i in range(actors)
    ]
    log.info(
        "ray: learner on %s:%d, %d actors (%g CPUs each), logdir %s on its node", host, port, actors, actor_cpus, logdir
    )
    try:
        actor_runs = _ActorRuns(ray, handles, actor_argv)
        return _supervise_learner(ray, learner, learner_argv, learner_restarts, actor_runs.poll)
    finally:
        _close(ray, [*handles, learner])
        ray.shutdown()


def _close(ray: Any, handles: list[Any]) -> None:
    """Each Ray actor stops its process and removes its files, then is killed; one that does
    not answer in time (a dead node) is killed as it is."""
    closing = [handle.close.remote() for handle in handles]
    ray.wait(closing, num_returns=len(closing), timeout=CLOSE_WAIT_S + 5.0)
    for handle in handles:
        ray.kill(handle, no_restart=True)


class _ActorRuns:
    """The actors' apex processes, each started again as under `apex run`, by apex rather than by
    Ray's task retries: when a Ray actor is killed, Ray may kill its child process first, and
    the task then returns that process's exit code (-9) instead of failing, so Ray does not
    retry it (seen here: the Ray actor came back without its process). A process that exits
    with an error starts again after a growing delay (0: it was told to stop); one whose Ray
    actor died starts again as soon as Ray has restarted that actor."""

    def __init__(self, ray: Any, handles: list[Any], argvs: list[list[str]]) -> None:
        self.ray, self.handles, self.argvs = ray, handles, argvs
        self.restarts = [0] * len(handles)
        self.start_at: dict[int, float] = dict.fromkeys(range(len(handles)), 0.0)
        self.pending: dict[Any, int] = {}
        self.poll()

    def poll(self) -> None:
        now = time.monotonic()
        for i, at in list(self.start_at.items()):
            if now >= at:
                del self.start_at[i]
                self.pending[self.handles[i].run.remote(self.argvs[i])] = i
        done = self.ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)[0] if self.pending else []
        for ref in done:
            i = self.pending.pop(ref)
            try:
                code = self.ray.get(ref)
            except self.ray.exceptions.RayError as e:
                log.warning("ray: actor %d died (%s); starting it again once Ray restarts it", i, type(e).__name__)
                self.start_at[i] = now
                continue
            if code != 0:
                delay = min(_RESTART_MAX_S, _ACTOR_RESTART_FIRST_S * 2 ** self.restarts[i])
                log.warning("ray: actor %d exited with %d; restarting in %.1fs", i, code, delay)
                self.start_at[i] = now + delay
                self.restarts[i] += 1


def _supervise_learner(
    ray: Any, learner: Any, argv: list[str], restarts: int, poll_actors: Callable[[], None] = lambda: None
) -> int:
    """Runs the learner until it exits for good (0, a usage error, an interrupt, or ``restarts``
    failures in a row), calling ``poll_actors`` as it waits; Ctrl-C or SIGTERM here stops it
    with its checkpoint."""
    failures = 0
    with StopSignals() as signals:
        while True:
            pending = learner.run.remote(argv)
            stopping = False
            while not ray.wait([pending], timeout=POLL_S)[0]:
                poll_actors()
                if signals.received and not stopping:
                    ray.get(learner.stop.remote())
                    stopping = True
            code = int(ray.get(pending))
            if code in (0, 2, 130) or signals.received or stopping:
                return code
            failures += 1
            if failures > restarts:
                log.error("ray: the learner exited with %d %d times in a row; stopping", code, failures)
                return code
            log.warning("ray: the learner exited with %d; starting it again from its newest checkpoint", code)
            time.sleep(min(2.0 * 2 ** (failures - 1), 30.0))


__all__ = ["ApexProcess", "run_on_ray"]
