"""A one-node Slurm cluster for the Slurm tests: munged, slurmctld and slurmd on this host,
configured in a directory of the test's (SLURM_CONF points every command at it), as root.
Debian's slurm-wlm and munge (.ci/run installs them); a test skips, saying why, where they
are missing or the daemons do not come up."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from apex.bench.serve_learning import stop_processes
from apex.bench.transport import free_base_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel")

CONF = """\
ClusterName=apextest
SlurmctldHost={host}
SlurmctldPort={port}
SlurmdPort={port_d}
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
KillWait=30
InactiveLimit=0
MinJobAge=300
NodeName={host} CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=apex Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def missing() -> str | None:
    """Why a cluster cannot be brought up here, or None."""
    if os.geteuid() != 0:
        return "the Slurm tests bring up slurmctld and slurmd as root"
    absent = [name for name in DAEMONS if shutil.which(name) is None]
    if absent:
        return f"no {', '.join(absent)} (apt-get install slurm-wlm munge; .ci/run does)"
    return None


@contextmanager
def one_node_cluster(directory: Path) -> Iterator[dict[str, str]]:
    """The cluster for the time of the block; yields the environment its commands need."""
    directory.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (directory / sub).mkdir(exist_ok=True)
    host = socket.gethostname().split(".")[0]

    conf = directory / "slurm.conf"
    conf.write_text(
        CONF.format(host=host, port=free_base_port(), port_d=free_base_port(), dir=directory, cpus=os.cpu_count() or 1)
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        _start_munge()
        for daemon in ("slurmctld", "slurmd"):
            log = open(directory / f"{daemon}.out", "w")
            daemons.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdout=log, stderr=log))
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                break
            if time.monotonic() > deadline or any(d.poll() is not None for d in daemons):
                logs = "\n".join(p.read_text()[-1500:] for p in sorted(directory.glob("*.log")) if p.exists())
                raise RuntimeError(f"the one-node Slurm cluster did not come up (sinfo: {state!r}):\n{logs}")
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True, check=False)
        stop_processes(daemons)


def _start_munge() -> None:
    """munged with a key (made if none), unless one answers already."""
    if subprocess.run(["munge", "-n"], capture_output=True, check=False).returncode == 0:
        return
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, capture_output=True)
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    for directory in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
        Path(directory).mkdir(parents=True, exist_ok=True)
        shutil.chown(directory, "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, capture_output=True)
    deadline = time.monotonic() + 10
    while subprocess.run(["munge", "-n"], capture_output=True, check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError("munged did not answer (munge -n)")
        time.sleep(0.2)


def wait_job(job: str, env: dict[str, str], timeout: float) -> str:
    """The job's final state (COMPLETED, FAILED, CANCELLED, ...) once it has left the queue."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["scontrol", "show", "job", job, "-o"], env=env, capture_output=True, text=True, check=False
        ).stdout
        state = next((f.split("=", 1)[1] for f in out.split() if f.startswith("JobState=")), "")
        if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED"):
            return state
        time.sleep(1.0)
    raise AssertionError(f"job {job} still queued or running after {timeout} s")
