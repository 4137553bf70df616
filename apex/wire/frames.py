"""Frame 0's bytes, and the packed form of a message's frames.

Frame 0 holds the header and every ``raw`` array::

    MAGIC (4 bytes) | header length H (uint32 LE) | header (H bytes) | padding to 8 | raw arrays

The magic (whose first byte msgpack never uses) tells a protocol-3 peer, whose frame 0 was a
bare msgpack map, from a garbled message, so that it hears which version to run.

ZeroMQ's CONFLATE option keeps only the last frame of a multipart message, so the weights
channel sends ``pack(frames)``: the same frames joined into one, split again by ``unpack``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from apex.errors import ProtocolError
from apex.wire.layout import MAX_ARRAYS, align

# 2: sessions (token and sequence number on every batch), learner incarnations; 3: the
# welcome's "setup"; 4: the header and the raw arrays share frame 0
PROTOCOL = 4
MAGIC = b"\xc1apx"  # 0xc1: the one byte msgpack never writes, so no header of protocol <= 3 starts so
MAX_HEADER_BYTES = 64 * 1024

PREFIX = struct.Struct("<4sI")  # MAGIC, header length
PREFIX_BYTES = PREFIX.size  # where the header starts in frame 0
_PACK_COUNT = struct.Struct("<I")
_PACK_SIZE = struct.Struct("<Q")

# msgpack raises ValueError subclasses (and UnpackException) for bad input, TypeError for an
# unhashable map key; NumPy ValueError for a buffer of the wrong size.
MALFORMED = (ValueError, TypeError, OverflowError, msgpack.UnpackException, struct.error)


def buffer_of(frame: Any) -> Any:
    """The bytes-like content of a frame: zmq.Frame exposes it as ``.buffer``."""
    return frame.buffer if hasattr(frame, "buffer") else frame


def peek_version(frame: Any) -> int | None:
    """The protocol version a header claims, or None: to reject a peer with a clear reason."""
    try:
        view = memoryview(buffer_of(frame)).cast("B")
        if len(view) >= PREFIX.size and view[: len(MAGIC)] == MAGIC:
            _, length = PREFIX.unpack_from(view)
            view = view[PREFIX.size : PREFIX.size + length]
        header = msgpack.unpackb(view, raw=False)  # up to protocol 3 frame 0 was the header alone
        version = header.get("v") if isinstance(header, dict) else None
        return version if isinstance(version, int) else None
    except MALFORMED:
        return None


def split_head(frame: Any) -> tuple[Any, Any]:
    """Frame 0's header bytes and, after it, its raw arrays' region (zero-copy views);
    raises ProtocolError."""
    head = memoryview(buffer_of(frame)).cast("B").toreadonly()
    if len(head) < PREFIX.size or head[: len(MAGIC)] != MAGIC:
        version = peek_version(frame)
        if version is not None and version != PROTOCOL:
            raise ProtocolError(
                f"protocol version {version!r}, expected {PROTOCOL}: run the same apex version on both sides"
            )
        raise ProtocolError("frame 0 does not start with an apex header")
    _, length = PREFIX.unpack_from(head)
    if length > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {length} bytes exceeds {MAX_HEADER_BYTES}")
    end = PREFIX.size + length
    if end > len(head):
        raise ProtocolError(f"header claims {length} bytes, frame 0 holds {len(head) - PREFIX.size}")
    return head[PREFIX.size : end], head[min(align(end), len(head)) :]


def header_of(frames: Sequence[Any]) -> dict[str, Any]:
    """The header map of a message's frames (for tools that inspect or forge messages)."""
    header, _ = split_head(frames[0])
    fields: dict[str, Any] = msgpack.unpackb(header, raw=False)
    return fields


def with_header(frames: Sequence[Any], header: Mapping[str, Any]) -> list[bytes]:
    """The same message with another header map (not checked): for tests and floods."""
    _, raw = split_head(frames[0])
    packed = msgpack.packb(dict(header), use_bin_type=True)
    padding = bytes(align(PREFIX.size + len(packed)) - PREFIX.size - len(packed)) if len(raw) else b""
    return [PREFIX.pack(MAGIC, len(packed)) + packed + padding + bytes(raw), *(bytes(buffer_of(f)) for f in frames[1:])]


def pack(frames: Sequence[bytes | bytearray]) -> bytes:
    """Joins frames into one (for CONFLATE sockets): count, sizes, then the frames."""
    sizes = b"".join(_PACK_SIZE.pack(len(f)) for f in frames)
    return b"".join([_PACK_COUNT.pack(len(frames)), sizes, *frames])


def unpack(frame: Any) -> list[memoryview]:
    """Splits a packed frame into zero-copy views of its frames; raises ProtocolError."""
    view = memoryview(buffer_of(frame)).cast("B")
    if len(view) < _PACK_COUNT.size:
        raise ProtocolError("packed message shorter than its frame count")
    (count,) = _PACK_COUNT.unpack_from(view)
    if count < 1 or count > MAX_ARRAYS + 2:
        raise ProtocolError(f"packed message claims {count} frames (1..{MAX_ARRAYS + 2} allowed)")
    offset = _PACK_COUNT.size + count * _PACK_SIZE.size
    if len(view) < offset:
        raise ProtocolError("packed message shorter than its frame table")
    sizes = [_PACK_SIZE.unpack_from(view, _PACK_COUNT.size + i * _PACK_SIZE.size)[0] for i in range(count)]
    if offset + sum(sizes) != len(view):
        raise ProtocolError(f"packed frame sizes add up to {offset + sum(sizes)} bytes, message has {len(view)}")
    frames = []
    for size in sizes:
        frames.append(view[offset : offset + size])
        offset += size
    return frames
