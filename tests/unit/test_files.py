"""Run-directory files: atomic writes that leave no temporary file and follow no link,
metrics.jsonl appended in place only, write errors (a full disk) survived and counted
(real write limits on a child process: tests/system/test_files.py)."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest

from apex.errors import ApexError
from apex.learner.metrics import MetricsWriter, write_json_atomic
from apex.system.files import RefusedFile, open_regular, read_regular, remove_stale_temps, write_atomic
from tests.support.checkpoints import within


class Quiet:
    """A console that is not a terminal (no status line; progress lines go nowhere)."""

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def row(n: int) -> dict:
    return {"time": float(n), "env_steps": 100 * n, "learner_updates": n, "loss": 0.5, "note": "x" * 100}


def victim(tmp_path: Path) -> Path:
    """A file outside the run directory that a planted link points at."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_text("precious\n")
    return path


# -- atomic writes


def test_write_atomic_writes_whole_files_under_unique_names(tmp_path):
    seen = []

    def write(f):
        seen.append(os.readlink(f"/proc/self/fd/{f.fileno()}"))
        f.write(b"data")
        return 7

    assert write_atomic(tmp_path / "a.json", write) == 7
    assert write_atomic(tmp_path / "a.json", write) == 7
    assert (tmp_path / "a.json").read_bytes() == b"data"
    assert os.listdir(tmp_path) == ["a.json"]
    first, second = seen
    assert first != second, "a predictable temporary name is one an attacker can plant a link at"
    assert Path(first).parent == tmp_path and first.endswith(".tmp")


def test_a_failed_write_leaves_no_temporary_file_and_the_old_file_intact(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"old": True})

    def full_disk(f):
        f.write(b"{partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as caught:
        write_atomic(path, full_disk)
    assert caught.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == ["summary.json"]
    assert json.loads(path.read_text()) == {"old": True}


def test_a_link_planted_at_the_old_temporary_name_redirects_nothing(tmp_path):
    target = victim(tmp_path)
    logdir = tmp_path / "run"
    logdir.mkdir()
    # The names the old code wrote through, with open(..., "w").
    (logdir / "summary.json.tmp").symlink_to(target)
    write_json_atomic(logdir / "summary.json", {"stop_reason": "done"})
    assert target.read_text() == "precious\n"
    assert json.loads((logdir / "summary.json").read_text()) == {"stop_reason": "done"}
    # A link at the destination itself is replaced by the file, not written through.
    (logdir / "summary.json").unlink()
    (logdir / "summary.json").symlink_to(target)
    write_json_atomic(logdir / "summary.json", {"stop_reason": "again"})
    assert target.read_text() == "precious\n"
    assert not (logdir / "summary.json").is_symlink()


def test_a_link_planted_at_a_checkpoint_temporary_name_redirects_nothing(tmp_path):
    from apex.checkpoint import CheckpointWriter, find_latest
    from tests.support.checkpoints import state

    target = victim(tmp_path)
    directory = tmp_path / "checkpoints"
    writer = CheckpointWriter(directory, keep=3)
    for suffix in (".pt", ".json", ".replay"):  # planted after the writer cleared stale ones
        (directory / f"ckpt-000000100{suffix}.tmp").symlink_to(target)
    assert writer.save("ckpt-000000100", state(100))
    assert writer.failures == 0 and target.read_text() == "precious\n"
    assert find_latest(directory).load_state()["updates"] == 100


def test_stale_temporary_files_are_removed_without_following_links(tmp_path):
    target = victim(tmp_path)
    logdir = tmp_path / "run"
    logdir.mkdir()
    (logdir / "summary.json.tmp").write_text("left by a killed learner")
    (logdir / "metrics.json.0123456789ab.tmp").symlink_to(target)
    (logdir / "folder.0123456789ab.tmp").mkdir()
    (logdir / "keep.json").write_text("{}")
    (logdir / "notes.tmp").write_text("a user's own file in a shared --logdir")
    MetricsWriter(logdir, console=Quiet(), tensorboard=False).close()
    assert sorted(os.listdir(logdir)) == ["folder.0123456789ab.tmp", "keep.json", "metrics.jsonl", "notes.tmp"]
    assert target.read_text() == "precious\n"
    assert remove_stale_temps(logdir) == 0


# -- metrics.jsonl in place


def test_a_link_planted_at_metrics_jsonl_is_refused_and_its_target_unchanged(tmp_path):
    target = victim(tmp_path)
    logdir = tmp_path / "run"
    logdir.mkdir()
    (logdir / "metrics.jsonl").symlink_to(target)
    with pytest.raises(ApexError) as caught:
        MetricsWriter(logdir, console=Quiet(), tensorboard=False)
    message = str(caught.value)
    assert "metrics.jsonl is a symbolic link" in message and "\n" not in message
    assert target.read_text() == "precious\n"


def test_a_fifo_at_metrics_jsonl_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "metrics.jsonl")
    with pytest.raises(ApexError, match="metrics.jsonl is not a regular file"):
        MetricsWriter(tmp_path, console=Quiet(), tensorboard=False)


def test_a_link_planted_at_the_tensorboard_directory_is_refused(tmp_path):
    target = victim(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tb").symlink_to(target.parent)
    with pytest.raises(ApexError, match="tb is a symbolic link"):
        MetricsWriter(tmp_path / "run", console=Quiet())
    assert os.listdir(target.parent) == ["precious.txt"]


# -- reading: regular files only (issue 30, item 8)


def test_read_regular_reads_a_regular_file_in_a_linked_run_directory(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "summary.json").write_text("{}\n")
    (tmp_path / "runs").symlink_to(tmp_path / "real")  # the user's own: only the last component must be no link
    assert read_regular(tmp_path / "runs" / "summary.json", 3) == b"{}\n"
    with open_regular(tmp_path / "runs" / "summary.json", 3) as f:
        assert f.read() == b"{}\n"


@pytest.mark.parametrize(
    "kind, said",
    [
        ("link to /dev/zero", "is a symbolic link, not a regular file"),
        ("fifo", "is a FIFO, not a regular file"),
        ("directory", "is a directory, not a regular file"),
    ],
)
def test_read_regular_refuses_what_is_not_a_regular_file_in_one_line_without_blocking(tmp_path, kind, said):
    path = tmp_path / "metrics.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    for read in (read_regular, open_regular):
        with pytest.raises(RefusedFile) as caught:
            within(10, lambda: read(path, 1 << 20))
        assert str(caught.value) == f"{path} {said}"


def test_read_regular_refuses_a_file_larger_than_it_may_be_before_reading_it(tmp_path):
    path = tmp_path / "ckpt-000000001.json"
    with path.open("wb") as f:
        f.truncate(1 << 40)  # a sparse terabyte: reading it would take minutes
    with pytest.raises(RefusedFile, match=f"ckpt-000000001.json has {1 << 40} bytes, more than the 1024 it may have"):
        within(10, lambda: read_regular(path, 1024))
    path.write_bytes(b"x" * 1024)
    assert read_regular(path, 1024) == b"x" * 1024


# -- write errors


def test_metrics_survive_a_full_disk_and_go_on_when_it_frees_up(tmp_path, monkeypatch, caplog):
    import apex.learner.metrics

    writer = MetricsWriter(tmp_path, console=Quiet(), tensorboard=False)
    real_write_all = apex.learner.metrics._write_all
    calls = []

    def full_disk(fd, data):
        calls.append(len(data))
        os.write(fd, data[:10])  # what a disk takes before it is full
        raise OSError(errno.ENOSPC, "No space left on device")

    writer.write(row(0))
    monkeypatch.setattr(apex.learner.metrics, "_write_all", full_disk)
    with caplog.at_level(logging.WARNING):
        for n in range(1, 6):
            writer.write(row(n))
    assert writer.write_failures == 5 and len(calls) == 5
    failures_logged = [r for r in caplog.records if "metrics.jsonl failed" in r.getMessage()]
    assert len(failures_logged) == 1 and "No space left on device" in failures_logged[0].getMessage()
    monkeypatch.setattr(apex.learner.metrics, "_write_all", real_write_all)
    writer.write(row(6))
    writer.close()
    # Whole lines only: the half lines were cut off again.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["learner_updates"] for r in rows] == [0, 6]
    assert writer.write_failures == 5


def test_tensorboard_is_turned_off_after_its_first_failure(tmp_path, caplog):
    writer = MetricsWriter(tmp_path, console=Quiet())

    class FullDisk:
        def add_scalar(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    writer._tb.close()
    writer._tb = FullDisk()
    with caplog.at_level(logging.WARNING):
        writer.write(row(1))
        writer.write(row(2))
        writer.close()
    assert writer.write_failures == 1
    assert caplog.text.count("TensorBoard output is off for the rest of the run") == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
