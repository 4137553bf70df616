"""A checkpoint's manifest (ckpt-N.json) checked field by field, and its files against it."""

from __future__ import annotations

import io
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apex.checkpoint.common import (
    FORMAT,
    MAX_MANIFEST_BYTES,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    finite_or_none,
    is_int,
    memory_bytes,
    score_of,
    show,
)
from apex.checkpoint.state import check_state, load_failure, read_state
from apex.system.files import RefusedFile, open_regular, read_regular

if TYPE_CHECKING:
    from apex.replay import StackedReplay
    from apex.wire.schema import BatchSchema

_READ_BYTES = 16 << 20


@dataclass
class Checkpoint:
    """A verified checkpoint: its manifest and the paths of its files."""

    manifest_path: Path
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return self.manifest_path.stem

    @property
    def config(self) -> dict[str, Any]:
        """The run's configuration, as saved with the checkpoint."""
        config: dict[str, Any] = self.manifest["config"]
        return config

    @property
    def logdir(self) -> Path:
        """The run directory the checkpoint belongs to (LOGDIR of LOGDIR/checkpoints)."""
        return self.manifest_path.parent.parent

    @property
    def state_path(self) -> Path:
        return self.manifest_path.with_suffix(".pt")

    @property
    def replay_path(self) -> Path | None:
        return self.manifest_path.with_suffix(".replay") if "replay" in self.manifest["files"] else None

    @property
    def score(self) -> float | None:
        """The run's return_mean_100 when it was written (None: no evaluation episode yet,
        or a checkpoint older than scores)."""
        return score_of(self.manifest)

    def load_state(self) -> dict[str, Any]:
        """The learner state (networks, optimizer, counters, config), loaded without running
        code; CorruptCheckpoint if it cannot be loaded or is not an apex learner state."""
        return check_state(read_state(self.state_path, self.manifest["files"]["state"]["bytes"]), self.state_path.name)

    @property
    def ranks(self) -> int:
        """Ranks of the learner group that wrote it (1: one learner process)."""
        return 1 + len(self.manifest.get("shards", []))

    def shard_path(self, rank: int) -> Path:
        """Where rank ``rank`` (> 0) of a learner group keeps its replay shard of this checkpoint."""
        return self.manifest_path.with_name(shard_file_name(self.name, rank))

    def load_shard(self, rank: int, replay: StackedReplay, schema: BatchSchema | None = None) -> None:
        """Fills ``replay`` (new and empty) from rank ``rank``'s shard, after checking the
        file's size and CRC-32; the errors of ``load_replay``."""
        entry = self.manifest["shards"][rank - 1]
        path = self.shard_path(rank)
        _check_file(path, entry)
        _check_replay_fits(entry["replay_header"], replay, self.name)
        try:
            with _open(path, entry["bytes"]) as f:
                replay.load(f, entry["replay_header"], schema)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise CorruptCheckpoint(
                f"{path.name} does not hold the replay shard its manifest describes ({load_failure(e)})"
            ) from None

    def load_replay(self, replay: StackedReplay, schema: BatchSchema | None = None) -> None:
        """Fills ``replay`` (new and empty, of the checkpoint's shape) from the replay file.
        IncompatibleCheckpoint if this run's replay has another shape; CorruptCheckpoint if
        the file does not hold what its header says, or (given the algorithm's batch
        ``schema``) values that a batch could not bring. After either, ``replay`` is still
        empty (its counters are set last), so the one before may be loaded into it.
        ValueError for a checkpoint without a replay file (``replay_path`` None)."""
        path = self.replay_path
        if path is None:
            raise ValueError(f"checkpoint {self.name} holds no replay")
        header = self.manifest["replay_header"]
        _check_replay_fits(header, replay, self.name)
        try:
            with _open(path, self.manifest["files"]["replay"]["bytes"]) as f:
                replay.load(f, header, schema)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise CorruptCheckpoint(
                f"{path.name} does not hold the replay its manifest describes ({load_failure(e)})"
            ) from None


def _check_replay_fits(header: dict[str, Any], replay: StackedReplay, name: str) -> None:
    """The replay's shape checked first: another shape is the run's configuration
    changing, not a damaged file."""
    if (mismatch := replay.shape_mismatch(header)) is not None:
        raise IncompatibleCheckpoint(
            f"{name}: {mismatch}: resume with the configuration the checkpoint was made "
            "with (drop the --set that changes it)"
        )


def verify(manifest_path: Path) -> Checkpoint:
    """The checkpoint of a manifest, after checking the manifest's every field and every
    file's size and CRC-32; CorruptCheckpoint (one line) saying what is wrong."""
    manifest_path = Path(manifest_path)
    manifest = read_manifest(manifest_path)
    checkpoint = Checkpoint(manifest_path, manifest)
    for kind, path in (("state", checkpoint.state_path), ("replay", checkpoint.replay_path)):
        if path is not None:
            _check_file(path, manifest["files"][kind])
    return checkpoint


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest: dict[str, Any] = json.loads(_read(path, MAX_MANIFEST_BYTES))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise CorruptCheckpoint(f"cannot read {path.name}: {e}") from e
    problems = _manifest_problems(manifest, path.stem)
    if problems:
        raise CorruptCheckpoint(
            f"{path.name} is not a valid apex checkpoint manifest of format {FORMAT}: " + "; ".join(problems)
        )
    return manifest


def _manifest_problems(manifest: Any, name: str) -> list[str]:
    """Every field the loaders rely on, checked before any is used."""
    if not isinstance(manifest, dict):
        return [f"it holds a {type(manifest).__name__}, not an object"]
    problems = []
    if manifest.get("format") != FORMAT:
        problems.append(f"format is {show(manifest.get('format'))}")
    if manifest.get("name") != name:
        problems.append(f"name is {show(manifest.get('name'))}, its file says {name!r}")
    if not isinstance(manifest.get("config"), dict):
        problems.append("config must be an object")
    # Optional (older manifests lack them); null before the run's first evaluation episode.
    score = manifest.get("return_mean_100")
    if score is not None and finite_or_none(score) is None:
        problems.append(f"return_mean_100 must be a finite number or null, got {show(score)}")
    episodes = manifest.get("eval_episodes")
    if episodes is not None and not is_int(episodes):
        problems.append(f"eval_episodes must be an int >= 0 or null, got {show(episodes)}")
    files = manifest.get("files")
    if not isinstance(files, dict) or "state" not in files:
        return [*problems, "files must be an object listing 'state'"]
    for kind, entry in files.items():
        problems += _file_entry_problems(kind, entry)
    if "replay" in files:
        problems += _replay_header_problems(manifest.get("replay_header"))
    shards = manifest.get("shards", [])  # a learner group's other ranks' replays
    if not isinstance(shards, list):
        return [*problems, f"shards must be a list, got {show(shards)}"]
    for rank, entry in enumerate(shards, start=1):
        if not isinstance(entry, dict) or entry.get("rank") != rank:
            problems.append(f"shards[{rank - 1}] must be an object of rank {rank}, got {show(entry)}")
            continue
        problems += _file_entry_problems("replay", entry)
        problems += [f"shards[{rank - 1}]: {p}" for p in _replay_header_problems(entry.get("replay_header"))]
    return problems


def shard_file_name(name: str, rank: int | str) -> str:  # rank "*": a glob of every rank's
    return f"{name}.rank{rank}.replay"


def _file_entry_problems(kind: Any, entry: Any) -> list[str]:
    if kind not in ("state", "replay"):
        return [f"files lists {show(kind)}, expected 'state' and optionally 'replay'"]
    if not (
        isinstance(entry, dict) and is_int(entry.get("bytes")) and is_int(entry.get("crc32")) and entry["crc32"] < 2**32
    ):
        return [f"files.{kind} must be {{bytes: int >= 0, crc32: int in [0, 2**32)}}, got {show(entry)}"]
    if entry["bytes"] > (memory := memory_bytes()):
        return [
            f"files.{kind} has {entry['bytes']} bytes, more than this machine's memory ({memory}) that it "
            "would be loaded into"
        ]
    return []


def _replay_header_problems(header: Any) -> list[str]:
    """What StackedReplay.load relies on (see StackedReplay.save)."""
    if not isinstance(header, dict):
        return [f"replay_header must be an object when a replay file is listed, got {show(header)}"]
    problems = []
    shape = header.get("frame_shape")
    if not (isinstance(shape, list) and all(is_int(n, 1) for n in shape)):
        problems.append(f"replay_header.frame_shape must be a list of positive ints, got {show(shape)}")
    if not isinstance(header.get("frame_dtype"), str):
        problems.append(f"replay_header.frame_dtype must be a string, got {show(header.get('frame_dtype'))}")
    for key in ("stack", "capacity", "frame_capacity", "chunk_items"):
        if not is_int(header.get(key), 1):
            problems.append(f"replay_header.{key} must be an int >= 1, got {show(header.get(key))}")
    if problems:  # the ranges below are checked against these
        return problems
    problems += _range_problems(header, "frames", header["frame_capacity"], "frame_capacity")
    problems += _range_problems(header, "items", header["capacity"], "capacity")
    return problems or _chunks_problems(header)


def _range_problems(header: dict[str, Any], key: str, capacity: int, capacity_key: str) -> list[str]:
    """[start, valid, end]: ids of the oldest saved, the oldest intact and one past the newest."""
    value = header.get(key)
    if not (isinstance(value, list) and len(value) == 3 and all(is_int(n) for n in value)):
        return [f"replay_header.{key} must be [start, valid, end], ints >= 0, got {show(value)}"]
    start, valid, end = value
    if not start <= valid <= end:
        return [f"replay_header.{key} must have start <= valid <= end, got {value}"]
    if end - start > capacity:
        return [f"replay_header.{key} spans {end - start}, more than {capacity_key} {capacity}"]
    return []


def _chunks_problems(header: dict[str, Any]) -> list[str]:
    """[end, first] pairs, oldest first: where each chunk's transitions end (insertion ids)
    and its first frame id. A chunk has one frame at least, so there are at most
    frame_capacity of them and their first frames strictly increase."""
    chunks = header.get("chunks")
    shape = (
        "replay_header.chunks must be a list of at most frame_capacity [end, first] pairs of ints >= 0, "
        "in insertion order, within items and frames"
    )
    if not isinstance(chunks, list) or len(chunks) > header["frame_capacity"]:
        return [shape]
    items_end, frames_end = header["items"][2], header["frames"][2]
    last_end, last_first = 0, -1
    for chunk in chunks:
        if not (isinstance(chunk, list) and len(chunk) == 2 and all(is_int(n) for n in chunk)):
            return [f"{shape}; got {show(chunk)}"]
        end, first = chunk
        if not (last_end <= end <= items_end and last_first < first < frames_end):
            return [f"{shape}; got {chunk} after {[last_end, last_first]}"]
        last_end, last_first = end, first
    return []


def _open(path: Path, max_bytes: int) -> io.BufferedReader:
    """A checkpoint's file opened if it is a regular file of at most ``max_bytes``;
    CorruptCheckpoint if it is not (a link, a FIFO: a planted file, set aside like any)."""
    try:
        return open_regular(path, max_bytes)
    except RefusedFile as e:
        raise CorruptCheckpoint(str(e)) from None


def _read(path: Path, max_bytes: int) -> bytes:
    try:
        return read_regular(path, max_bytes)
    except RefusedFile as e:
        raise CorruptCheckpoint(str(e)) from None


def _check_file(path: Path, expected: dict[str, Any]) -> None:
    try:
        # Any size opens, so that a short file is said to be truncated; no more than the
        # manifest's is read (a file of another size fails either way).
        with _open(path, memory_bytes()) as f:
            size, crc = os.fstat(f.fileno()).st_size, 0
            if size == expected["bytes"]:
                size, crc = _crc(f, expected["bytes"] + 1)
    except OSError as e:
        raise CorruptCheckpoint(f"{path.name}: {e.strerror}") from e
    if size != expected["bytes"]:
        raise CorruptCheckpoint(f"{path.name} has {size} bytes, its manifest says {expected['bytes']} (truncated?)")
    if crc != expected["crc32"]:
        raise CorruptCheckpoint(f"{path.name} fails its CRC-32 check (corrupted on disk)")


def _crc(f: io.BufferedReader, max_bytes: int) -> tuple[int, int]:
    """(bytes read, their CRC-32), of at most ``max_bytes``."""
    crc, size = 0, 0
    while size < max_bytes and (chunk := f.read(min(_READ_BYTES, max_bytes - size))):
        crc = zlib.crc32(chunk, crc)
        size += len(chunk)
    return size, crc
