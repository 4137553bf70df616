"""deploy/ for real: the image built from deploy/Dockerfile, offline, runs `apex`; the compose
file trains a learner and two actors to a summary.json; a learner that crashes comes back
through `restart: on-failure` and resumes from its checkpoint, and the actors reconnect.

No image registry or package index is needed: the base images are Debian bookworm made by
deploy/base-image.sh (debootstrap, from the host's Debian mirror; needs root), the wheels
come from the host's pip (`pip download`) into a wheelhouse the build installs from with
--no-index. Both are cached between runs in APEX_CONTAINER_CACHE (default
$XDG_CACHE_HOME/apex-container-test), keyed by their inputs. Skipped only where no container
engine answers (`docker info`); .ci/run installs and starts one. On two cores about 4.5
minutes cold (debootstrap ~80 s, the build ~2 min) and 2.5-3.5 warm; each phase's wall time,
the image size and the total are printed.

Everything the test makes is named after this run (images, compose projects) and removed at
the end, also on failure: containers, networks, volumes, images. The containers talk only to
each other; the learner's ports are published on the host's loopback only, on free ports.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

from apex.checkpoint import has_checkpoint
from tests.support.paths import ROOT

# Uncached, the image's fixture alone may take debootstrap, a wheelhouse download and a build
# (each with its own timeout below): more than pyproject's 10 minutes a test.
# `container`: it needs a container engine (skipped without one; -m "not container" leaves it out).
pytestmark = [pytest.mark.timeout(1800), pytest.mark.container]

DEPLOY = ROOT / "deploy"
MAX_IMAGE_BYTES = 1.2e9
CACHE = Path(
    os.environ.get("APEX_CONTAINER_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "apex-container-test"
)
RUN_ID = uuid.uuid4().hex[:8]  # names this run's images and compose projects
# The image's Python (Debian bookworm's) and platform, for which pip downloads wheels
# whatever the host's own Python and C library are.
WHEEL_TARGET = [
    "--only-binary=:all:",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
    *(arg for minor in range(36, 16, -1) for arg in ("--platform", f"manylinux_2_{minor}_x86_64")),
    "--platform",
    "manylinux2014_x86_64",
]
# Copied into the build context: what deploy/Dockerfile reads (.dockerignore filters again).
CONTEXT_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv*",
    "build",
    "*.egg-info",
    "__pycache__",
    "*.so",
    ".hypothesis",
    ".pytest_cache",
    ".ruff_cache",
    "runs",
)


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and out.returncode != 0:
        raise AssertionError(
            f"docker {' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    return out


@pytest.fixture(scope="module")
def say(request):
    """Prints past pytest's capture (phase times and the image size belong in every run's
    output); at the end, the module's total, teardown included."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.getplugin("terminalreporter"), plugins.getplugin("capturemanager")

    def say(message: str) -> None:
        if reporter is None or capture is None:
            print(f"[container test] {message}", file=sys.stderr)
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"[container test] {message}")

    start = time.monotonic()
    yield say
    say(f"total: {time.monotonic() - start:.1f} s")


@contextlib.contextmanager
def phase(say, name: str):
    start = time.monotonic()
    try:
        yield
    finally:
        say(f"{name}: {time.monotonic() - start:.1f} s")


@pytest.fixture(scope="module")
def engine():
    """The container engine, or a skip saying why there is none."""
    if shutil.which("docker") is None:
        pytest.skip("no container engine: the docker CLI is not installed (.ci/run installs docker.io)")
    info = docker("info", "--format", "{{.ServerVersion}}", timeout=60, check=False)
    if info.returncode != 0:
        reason = (info.stderr.strip().splitlines() or ["docker info failed"])[-1]
        pytest.skip(f"no container engine answers: {reason}")
    # Not skipped from here on: with an engine, what the test needs besides is a failure.
    assert shutil.which("debootstrap"), "debootstrap is needed for the base images (apt-get install debootstrap)"
    assert os.geteuid() == 0, "deploy/base-image.sh (debootstrap) needs root"
    return info.stdout.strip()


@pytest.fixture(scope="module")
def compose_cli(engine) -> list[str]:
    """`docker compose` (v2) or `docker-compose` (1.x): the compose file works with both."""
    if docker("compose", "version", check=False).returncode == 0:
        return ["docker", "compose"]
    assert shutil.which("docker-compose"), "neither `docker compose` nor docker-compose is installed"
    return ["docker-compose"]


def cached(name: str, key: str, make, say) -> Path:
    """CACHE/name-key, made by make(dir) unless there (older keys of name are dropped). A lock
    keeps concurrent runs from making it twice; a failed make leaves nothing behind."""
    CACHE.mkdir(parents=True, exist_ok=True)
    target = CACHE / f"{name}-{key}"
    with open(CACHE / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            say(f"{name}: cached in {target}")
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE))
        try:
            make(tmp)
            for old in CACHE.glob(f"{name}-*"):
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def base_images(engine, say):
    """(base, build) images imported from deploy/base-image.sh's root filesystems."""
    script = DEPLOY / "base-image.sh"

    def make(out: Path) -> None:
        # 0755: apt inside the chroot drops to its _apt user, which must reach the tree.
        out.chmod(0o755)
        result = subprocess.run([str(script), str(out)], capture_output=True, text=True, timeout=400, check=False)
        assert result.returncode == 0, f"deploy/base-image.sh failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"

    with phase(say, "base root filesystems (debootstrap, or the cache)"):
        rootfs = cached("base", digest(script.read_bytes()), make, say)
    tags = (f"apex-test-base:{RUN_ID}", f"apex-test-build:{RUN_ID}")
    try:
        with phase(say, "docker import of the two base images"):
            for tar, tag in zip(("base.tar", "build.tar"), tags, strict=True):
                docker("import", "--change", 'CMD ["/bin/bash"]', str(rootfs / tar), tag, timeout=300)
        yield tags
    finally:
        with phase(say, "teardown: base images removed"):
            docker("rmi", *tags, check=False)


@pytest.fixture(scope="module")
def wheelhouse(engine, say) -> Path:
    """Every wheel the image needs (apex's dependencies with the Dockerfile's default extras,
    torch pinned by constraints.txt, and the build requirements), from the host's pip."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+ (tomllib)")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    requirements = sorted(
        [
            *project["project"]["dependencies"],
            *extras["atari"],
            *extras["serve"],
            *extras["multiagent"],
            *project["build-system"]["requires"],
            "wheel",
        ]
    )
    constraints = (ROOT / "constraints.txt").read_text()

    def make(out: Path) -> None:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--dest",
                str(out),
                "--constraint",
                str(ROOT / "constraints.txt"),
                *WHEEL_TARGET,
                *requirements,
            ],
            capture_output=True,
            text=True,
            timeout=400,
            check=False,
        )
        assert result.returncode == 0, f"pip download failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"

    with phase(say, "wheelhouse (pip download, or the cache)"):
        return cached("wheels", digest(*requirements, constraints, *WHEEL_TARGET), make, say)


@pytest.fixture(scope="module")
def image(base_images, wheelhouse, tmp_path_factory, say):
    """The image of deploy/Dockerfile, built from the repository and the wheelhouse only."""
    context = tmp_path_factory.mktemp("context") / "apex"
    shutil.copytree(ROOT, context, ignore=CONTEXT_IGNORE)
    # Links where the file system allows (the wheels are ~300 MB), copies where not.
    shutil.copytree(wheelhouse, context / "wheelhouse", copy_function=link_or_copy)
    base, build = base_images
    tag, stage = f"apex-test:{RUN_ID}", f"apex-test-stage:{RUN_ID}"
    args = [
        "build",
        "--force-rm",
        "-f",
        "deploy/Dockerfile",
        "--build-arg",
        f"BASE_IMAGE={base}",
        "--build-arg",
        f"BUILD_IMAGE={build}",
        "--build-arg",
        "WHEELHOUSE=wheelhouse",
    ]
    try:
        with phase(say, "docker build (offline, from the wheelhouse)"):
            # The build stage is tagged too so that it can be removed with the image (the
            # classic builder keeps it as an untagged image); the second build reuses it.
            for target in (["--target", "build", "-t", stage], ["-t", tag]):
                result = subprocess.run(
                    ["docker", *args, *target, str(context)],
                    cwd=context,
                    capture_output=True,
                    text=True,
                    timeout=480,
                    check=False,
                )
                assert result.returncode == 0, f"docker build failed:\n{result.stdout[-4000:]}{result.stderr[-4000:]}"
        yield tag
    finally:
        with phase(say, "teardown: image and build stage removed"):
            docker("rmi", tag, stage, check=False, timeout=300)


def link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def test_image_runs_apex(image, say):
    with phase(say, "apex --help in the image"):
        help_text = docker("run", "--rm", image, "--help").stdout
        assert "usage: apex" in help_text
        # The non-root user, and the native extension and torch in the venv the build made.
        probe = docker(
            "run",
            "--rm",
            "--entrypoint",
            "python",
            image,
            "-c",
            "import os, torch, apex.native, apex.algos.impala.learner, apex.serve.http_frontend; "
            "print(os.getuid(), torch.__version__)",
        ).stdout.split()
    assert probe[0] == "10001"
    assert probe[1].startswith("2.13.0")


def test_image_size(image, say):
    size = int(docker("image", "inspect", "--format", "{{.Size}}", image).stdout)
    say(f"image size: {size / 1e9:.2f} GB (limit {MAX_IMAGE_BYTES / 1e9:.1f} GB)")
    assert size <= MAX_IMAGE_BYTES


def free_ports(count: int = 3) -> int:
    """A first port P with P..P+count-1 free on the loopback (the learner's three ports)."""
    for _ in range(100):
        first = 20000 + int.from_bytes(os.urandom(2), "big") % 30000
        with contextlib.ExitStack() as stack:
            try:
                for port in range(first, first + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return first
    raise AssertionError("no free ports on the loopback")


class Compose:
    """One compose project of deploy/docker-compose.yml with an override file: its settings
    through --env-file (every variable of .env.example, so that a deploy/.env of a user's does
    not count), its containers found by compose's labels."""

    def __init__(
        self,
        cli: list[str],
        image: str,
        workdir: Path,
        run_name: str,
        learner_flags: list[str],
        settings: dict[str, str] | None = None,
    ):
        self.project = f"apex-test-{RUN_ID}-{run_name}"
        self.runs = workdir / "runs"
        self.runs.mkdir(parents=True)
        self.runs.chmod(0o777)  # the containers write as uid 10001
        self.logdir = self.runs / run_name
        given, settings = (
            settings or {},
            dict(
                line.split("=", 1)
                for line in (DEPLOY / ".env.example").read_text().splitlines()
                if line and not line.startswith("#")
            ),
        )
        first = free_ports()
        settings.update(
            APEX_IMAGE=image,
            APEX_RUNS_DIR=str(self.runs),
            APEX_RUN_NAME=run_name,
            APEX_HOST_PORTS=f"{first}-{first + 2}",
            APEX_PUBLISH_HOST="127.0.0.1",
            APEX_ACTORS="2",
        )
        settings.update(given)
        env_file = workdir / "compose.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        # The learner's command as the compose file has it, plus this test's flags.
        command = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["learner"]["command"]
        override = workdir / "override.yml"
        override.write_text(yaml.safe_dump({"services": {"learner": {"command": [*command, *learner_flags]}}}))
        self.cli = [
            *cli,
            "--env-file",
            str(env_file),
            "-p",
            self.project,
            "-f",
            str(DEPLOY / "docker-compose.yml"),
            "-f",
            str(override),
        ]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("APEX_", "COMPOSE_"))}

    def __call__(self, *args: str, timeout: float = 180) -> str:
        out = subprocess.run(
            [*self.cli, *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        assert out.returncode == 0, (
            f"{' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
        return out.stdout

    def containers(self, service: str) -> list[str]:
        return docker(
            "ps",
            "-aq",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
        ).stdout.split()

    def learner(self) -> str:
        (container,) = self.containers("learner")
        return container

    def logs(self, container: str) -> str:
        out = docker("logs", container, check=False)
        return out.stdout + out.stderr

    def down(self) -> None:
        """Everything of the project, whatever state it is in: containers, network, volumes."""
        subprocess.run(
            [*self.cli, "down", "-v", "--remove-orphans", "--timeout", "10"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        label = f"label=com.docker.compose.project={self.project}"
        for kind in ("container", "network", "volume"):
            left = docker(
                kind, "ls", "-q", *(["-a"] if kind == "container" else []), "--filter", label, check=False
            ).stdout.split()
            if left:
                docker(kind, "rm", *(["-f"] if kind != "network" else []), *left, check=False)

    def metrics(self) -> list[dict]:
        path = self.logdir / "metrics.jsonl"
        if not path.exists():
            return []
        # The last line may be half written; the rows before it are whole.
        rows = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
        return rows


def state(container: str) -> dict:
    return json.loads(docker("inspect", "--format", "{{json .State}}", container).stdout)


def restart_count(container: str) -> int:
    return int(docker("inspect", "--format", "{{.RestartCount}}", container).stdout)


def wait_for(what: str, condition, timeout: float, compose: Compose, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    logs = "\n".join(
        f"--- {service} {c[:12]}\n{compose.logs(c)[-3000:]}"
        for service in ("learner", "actor")
        for c in compose.containers(service)
    )
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{logs}")


@pytest.fixture
def project(compose_cli, image, tmp_path, say):
    """Makes Compose projects; every one is taken down at the end, also on failure."""
    made = []

    def make(run_name: str, learner_flags: list[str], settings: dict[str, str] | None = None) -> Compose:
        made.append(Compose(compose_cli, image, tmp_path / run_name, run_name, learner_flags, settings))
        return made[-1]

    yield make
    for compose in made:
        with phase(say, f"teardown: compose project {compose.project} down"):
            compose.down()


def joined(log: str) -> collections.Counter:
    """How often the learner said `actor N joined`, by N."""
    return collections.Counter(int(n) for n in re.findall(r"\bactor (\d+) joined\b", log))


def run_to_the_end(compose: Compose) -> str:
    """Brings the project up and waits until the learner and both actors have exited, each
    with 0 (the actors told to stop, not crashed); the learner's log."""
    compose("up", "-d", "--no-build")
    containers = [compose.learner(), *compose.containers("actor")]
    assert len(containers) == 3, containers
    wait_for(
        "the learner and the actors to exit",
        lambda: all(state(c)["Status"] == "exited" for c in containers),
        240,
        compose,
    )
    for container in containers:
        assert state(container)["ExitCode"] == 0, compose.logs(container)[-3000:]
    return compose.logs(containers[0])


def test_compose_trains_to_a_summary(project, say):
    compose = project("train", ["--stop-env-steps", "20000"])
    with phase(say, "compose: keygen, learner and 2 actors to 20k env steps"):
        learner_log = run_to_the_end(compose)
    summary = json.loads((compose.logdir / "summary.json").read_text())
    assert summary["env_steps"] >= 20000 and "env steps" in summary["stop_reason"], summary
    assert summary["learner_updates"] > 0
    # Each actor answered once at its hello, although the actors start with the learner.
    assert joined(learner_log) == {0: 1, 1: 1}, learner_log[-3000:]


def test_compose_trains_a_multi_agent_run(project, say):
    """The image has PettingZoo: compose runs tictactoe's self-play preset as it is."""
    compose = project("tictactoe", ["--stop-env-steps", "5000"], {"APEX_CONFIG": "tictactoe_apex"})
    with phase(say, "compose: tictactoe self-play, learner and 2 actors to 5k env steps"):
        learner_log = run_to_the_end(compose)
    summary = json.loads((compose.logdir / "summary.json").read_text())
    assert summary["env_steps"] >= 5000 and summary["policies"]["shared"]["learner_updates"] > 0, summary
    assert joined(learner_log) == {0: 1, 1: 1}, learner_log[-3000:]
    assert compose.metrics()[-1]["rejected_messages"] == 0


def test_compose_learner_comes_back_after_a_crash(project, image, say):
    compose = project("crash", ["--stop-env-steps", "100000000", "--set", "learner.checkpoint_interval_updates=100"])
    with phase(say, "compose: up to the first checkpoint"):
        compose("up", "-d", "--no-build")
        learner = compose.learner()
        wait_for(
            "a checkpoint and both actors in the metrics",
            lambda: has_checkpoint(compose.logdir) and any(r["actors_connected"] == 2 for r in compose.metrics()),
            180,
            compose,
        )
    with phase(say, "compose: learner killed, restarted, resumed, actors back"):
        rows_before = len(compose.metrics())
        # SIGKILL from outside, as a crash would end it: `docker kill` and `docker stop` are
        # manual stops, which the restart policy leaves alone. The learner runs as uid 10001;
        # a container of that user in the host's PID namespace signals it (no root needed).
        pid = state(learner)["Pid"]
        docker("run", "--rm", "--pid=host", "--network=none", "--entrypoint", "sh", image, "-c", f"kill -KILL {pid}")
        wait_for(
            "docker to restart the learner",
            lambda: restart_count(learner) >= 1 and state(learner)["Running"],
            60,
            compose,
        )
        wait_for(
            "the learner to resume from its checkpoint",
            lambda: re.search(r"resumed from ckpt-", compose.logs(learner)),
            120,
            compose,
        )

        def actors_back() -> bool:
            new = compose.metrics()[rows_before:]
            connected = [r for r in new if r["actors_connected"] == 2]
            return len(connected) >= 2 and connected[-1]["env_steps"] > connected[0]["env_steps"]

        wait_for("both actors to send again to the resumed learner", actors_back, 120, compose)
    log = compose.logs(learner)
    after = log[log.index("resumed from ckpt-") :]
    assert sum(joined(after).values()) >= 2, after[-3000:]  # the actors said hello again
    assert restart_count(learner) == 1
    assert all(restart_count(actor) == 0 for actor in compose.containers("actor")), "actors reconnect, not restart"
