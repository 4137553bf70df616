"""Files in a run directory: written whole or not at all, read and written never through a link.

A run directory may be shared, or left where others can write. Whoever plants a symbolic
link at a name apex writes (``metrics.jsonl``, a predictable ``*.tmp``) must not make apex
write somewhere else: temporary files get unique names and are created exclusively
(``O_EXCL`` refuses any existing name, a link included), and files appended to are opened
with ``O_NOFOLLOW``. Nor must what is planted at a name apex reads make it read without end
(a link to ``/dev/zero``) or wait for ever (a FIFO): ``open_regular`` opens regular files
only, of at most the size the caller expects.
"""

from __future__ import annotations

import errno
import io
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

from apex.errors import ApexError

T = TypeVar("T")

TMP_SUFFIX = ".tmp"  # every temporary name ends so: what remove_stale_temps looks for
_CREATE_ATTEMPTS = 8


def write_atomic(path: Path, write: Callable[[BinaryIO], T]) -> T:
    """Calls ``write`` with a new file beside ``path``, then fsyncs it and renames it to
    ``path`` (replacing a link there, never writing through it); returns what ``write``
    returned. On any failure the temporary file is removed and the error raised."""
    path = Path(path)
    tmp, fd = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            result = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    return result


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # the error that brought us here is the one to report
        pass


def _create_temp(path: Path) -> tuple[Path, int]:
    """A new file named ``<name>.<random>.tmp`` in ``path``'s directory, and its descriptor."""
    for _ in range(_CREATE_ATTEMPTS):
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(6)}{TMP_SUFFIX}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:  # 48 random bits taken already: planted, or very bad luck
            continue
        return tmp, fd
    raise FileExistsError(
        errno.EEXIST, f"no free temporary name for {path.name} after {_CREATE_ATTEMPTS} tries", str(path.parent)
    )


def open_append(path: Path) -> int:
    """A descriptor appending to the regular file ``path`` (created if absent). ApexError
    if ``path`` is a link or not a regular file (a FIFO would block, a device would take
    the writes); OSError for anything else (permissions, disk)."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):  # what O_NOFOLLOW answers for a link
            raise ApexError(_not_written_through(path, "is a symbolic link")) from None
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO nobody reads, a directory
            raise ApexError(_not_written_through(path, "is not a regular file")) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ApexError(_not_written_through(path, "is not a regular file"))
    os.set_blocking(fd, True)
    return fd


class RefusedFile(ApexError):
    """A run-directory file that is a link, not a regular file, or larger than it may be. The
    message names the file and what it is; the caller says what is done about it (a
    checkpoint is set aside, the one before used)."""


_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular(path: Path, max_bytes: int) -> io.BufferedReader:
    """``path`` opened for reading, if it is a regular file of at most ``max_bytes`` bytes;
    RefusedFile (one line: what it is instead) if it is a symbolic link (its last component:
    a linked run directory is the user's own), anything but a regular file, or larger;
    OSError if it cannot be opened (missing, permissions). Never blocks on a FIFO, never
    opens a device. The caller reads at most ``max_bytes`` (``read_regular``: the file may
    grow after the check)."""
    path = Path(path)
    _check_regular(path, os.lstat(path), max_bytes)  # before opening: opening a device may do things
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):  # a link put there since the lstat
            raise RefusedFile(f"{path} is a symbolic link, not a regular file") from None
        raise
    try:
        _check_regular(path, os.fstat(fd), max_bytes)  # what was opened, whatever lstat saw
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The whole of the regular file ``path`` (see ``open_regular``), at most ``max_bytes``."""
    with open_regular(path, max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise RefusedFile(f"{path} grew past {max_bytes} bytes while it was read")
    return data


def _check_regular(path: Path, status: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(status.st_mode):
        kind = next((name for is_kind, name in _KINDS if is_kind(status.st_mode)), "a special file")
        raise RefusedFile(f"{path} is {kind}, not a regular file")
    if status.st_size > max_bytes:
        raise RefusedFile(f"{path} has {status.st_size} bytes, more than the {max_bytes} it may have")


def refuse_link(path: Path) -> None:
    """ApexError if ``path`` is a symbolic link: for a directory apex writes into."""
    if Path(path).is_symlink():
        raise ApexError(_not_written_through(path, "is a symbolic link"))


def _not_written_through(path: Path, what: str) -> str:
    return (
        f"{path} {what}: apex writes its run files only in place, never through a link or into "
        "a special file; remove it or choose another --logdir"
    )


_OUR_TEMP = re.compile(r".+\.[0-9a-f]{12}\.tmp|.+\.(json|pt|replay|yaml)\.tmp")  # ours, and older apex's


def remove_stale_temps(directory: Path) -> int:
    """Removes the temporary files (and links) that apex names (``<name>.<12 hex>.tmp``,
    and an older apex's ``<name>.tmp`` of its own files) directly in ``directory``, left by
    a process killed while writing; a user's other ``*.tmp`` files in a shared --logdir stay.
    Never follows a link, never touches a directory. Returns how many."""
    removed = 0
    for entry in os.scandir(directory):
        if _OUR_TEMP.fullmatch(entry.name) and not entry.is_dir(follow_symlinks=False):
            try:
                os.unlink(entry.path)  # a link is removed, not what it points to
            except FileNotFoundError:
                continue
            removed += 1
    return removed


_LOCK_NAME = ".learner.lock"


def hold_run_directory(directory: Path, lock: bool = True) -> int | None:
    """Makes the run directory and, with ``lock``, takes it for this process (an flock on
    ``directory/.learner.lock``, which the kernel lets go when the process ends, however it
    ends): the lock's fd, to be kept open, or None. Two learners writing one directory would
    mix their checkpoints, self-play pools and metrics; the second is refused, naming the
    first's pid. (A learner group's rank 0 takes it; the other ranks write their own shards.)"""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    if not lock:
        return None
    path = directory / _LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ApexError(
            f"cannot take the run directory's lock {path} ({e.strerror}): remove it if it is a link or "
            "a special file, or choose another --logdir"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ApexError(f"{path} is not a regular file: remove it and start again")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ApexError(
            f"{directory} is in use by another learner (pid {holder[:16]}): give this run a --logdir of its own, "
            "or stop that learner first"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
