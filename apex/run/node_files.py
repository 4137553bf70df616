"""The files a Ray actor of `apex run --ray` puts on its node for the apex process it runs (the
run's config, its CURVE keys): each 0600 in a directory of its own, 0700, there only while the
process runs, and gone too when the Ray actor dies without closing (its node stopped or
killed, `ray kill`): a janitor process, in a session of its own so that what kills the Ray
worker leaves it alone, waits for the worker's pid to end and then removes the directory. The
directory is named after the worker's pid as well, so the janitor of a worker that died cannot
remove the files of the one Ray started in its place. Run as ``python -m apex.run.node_files
PID DIRECTORY``, this module is that janitor.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFIX = "apex-ray-"
_POLL_S = 0.5


class NodeFiles:
    """``files`` (relative path -> bytes) written under the temporary directory as ``name``."""

    def __init__(self, files: dict[str, bytes], name: str) -> None:
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"node files are named {PREFIX}<run>-<role>, got {name!r}")
        for file in files:
            if Path(file).is_absolute() or ".." in Path(file).parts:
                raise ValueError(f"a node file must stay in its directory, got {file!r}")
        self.files = files
        self.directory = Path(tempfile.gettempdir(), f"{name}-{os.getpid()}")
        self.janitor: subprocess.Popen[bytes] | None = None

    def write(self) -> Path:
        """The files, afresh (a restarted process gets them again), each 0600 in a 0700
        directory; the janitor started on first use."""
        self.remove()
        self.directory.mkdir(mode=0o700)
        for file, data in self.files.items():
            path = self.directory / file
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Created 0600: no moment when another user may read a secret key (umask applies
            # after, and can only take bits away).
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        if self.janitor is None:
            self.janitor = subprocess.Popen(
                [sys.executable, "-m", __name__, str(os.getpid()), str(self.directory)],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        return self.directory

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def close(self) -> None:
        """Removes the files and ends the janitor (nothing left for it)."""
        self.remove()
        if self.janitor is not None and self.janitor.poll() is None:
            self.janitor.terminate()
            self.janitor.wait(5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the number: ours is gone
        return False
    try:  # a zombie has ended too (its parent, Ray's raylet, may not reap it at once)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def janitor(pid: int, directory: Path) -> None:
    """Waits for ``pid`` to end, then removes ``directory`` (only a node files' directory of
    the temporary directory, never a link)."""
    if directory.parent != Path(tempfile.gettempdir()) or not directory.name.startswith(PREFIX):
        raise SystemExit(f"apex.run.node_files: {directory} is not a directory of node files")
    while _alive(pid):
        time.sleep(_POLL_S)
    if directory.is_dir() and not directory.is_symlink():
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    janitor(int(sys.argv[1]), Path(sys.argv[2]))
