"""The wire protocol: message types and the one codec pair, ``encode`` / ``decode``.

A message is a list of ZeroMQ frames. Frame 0 is a msgpack map::

    {"v": PROTOCOL, "type": "batch", <the type's fields>,
     "arrays": [{"name": "obs", "dtype": "<f4", "shape": [256, 4],
                 "codec": "raw" | "lz4", "nbytes": 4096, "size": 4096}, ...]}

and each array follows in a frame of its own (``size`` bytes on the wire, ``nbytes`` once
decoded). ``decode`` checks everything before it allocates anything: the protocol version,
the type and its fields, a whitelist of little-endian dtypes, shapes that agree with the
declared sizes, sizes under the caps, and the exact length of every lz4 payload. Anything
wrong raises ``ProtocolError``, never another exception. There is no pickle anywhere.

Decoded arrays are read-only: a ``raw`` array is a view over its received frame (no copy),
an ``lz4`` array a view over its freshly decompressed bytes. ``encode`` always copies or
compresses array data into bytes of its own, so a caller may reuse its arrays right after
and frames may be sent zero-copy without tearing.

ZeroMQ's CONFLATE option keeps only the last frame of a multipart message, so the weights
channel sends ``pack(frames)``: the same frames joined into one, split again by ``unpack``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lz4.block
import msgpack
import numpy as np

from apex.errors import ProtocolError

PROTOCOL = 1

# Header fields of each message type: name -> accepted Python types. Every field is
# required; a header may not carry fields its type does not list.
_INT = (int,)
_OPT_INT = (int, type(None))
_STR = (str,)
_MAP = (dict,)
MESSAGE_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    # actor -> learner, control channel
    "hello": {"actor_index": _OPT_INT, "num_envs": _INT, "host": _STR, "pid": _INT},
    "heartbeat": {"actor_index": _OPT_INT},
    # learner -> actor, control channel
    "welcome": {"actor_index": _INT, "spec": _MAP},
    "reject": {"reason": _STR},
    "stop": {"reason": _STR},
    "heartbeat_ack": {"weights_version": _INT},
    # actor -> learner, trajectory stream
    "batch": {"actor_index": _INT, "weights_version": _INT, "info": _MAP},
    # learner -> actors, weights channel (and control, right after a welcome)
    "weights": {"version": _INT},
}
_ARRAYS_ALLOWED = {"batch", "weights"}

# Little-endian (or byte-sized) dtypes only: what a decoder may be asked to allocate.
DTYPES = frozenset(
    np.dtype(t).str
    for t in (
        np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32,
        np.uint64, np.int64, np.float16, np.float32, np.float64,
    )
)
CODECS = ("raw", "lz4")

MAX_HEADER_BYTES = 64 * 1024
MAX_ARRAYS = 256
MAX_NDIM = 8
DEFAULT_MAX_ARRAY_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024
LZ4_MIN_BYTES = 4096  # smaller arrays go raw: compressing them costs more than it saves


@dataclass
class Message:
    """A decoded message: its type, its header fields and its named arrays."""

    type: str
    fields: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def encode(
    msg_type: str,
    fields: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray] | None = None,
    *,
    compress: bool = True,
) -> list[bytes]:
    """Encodes a message into frames; raises ProtocolError if it would not decode.

    With ``compress`` an array of at least LZ4_MIN_BYTES goes lz4 when that makes it smaller.
    """
    _check_fields(msg_type, fields)
    arrays = arrays or {}
    if arrays and msg_type not in _ARRAYS_ALLOWED:
        raise ProtocolError(f"a {msg_type!r} message carries no arrays")
    descriptors, payloads = [], []
    for name, array in arrays.items():
        array = np.asarray(array)
        if array.dtype.str not in DTYPES:
            raise ProtocolError(f"array {name!r} has dtype {array.dtype.str}, not one of {sorted(DTYPES)}")
        raw = np.ascontiguousarray(array).tobytes()
        codec, payload = "raw", raw
        if compress and len(raw) >= LZ4_MIN_BYTES:
            packed = lz4.block.compress(raw, store_size=False)
            if len(packed) < len(raw):
                codec, payload = "lz4", packed
        descriptors.append(
            {
                "name": name,
                "dtype": array.dtype.str,
                "shape": list(array.shape),
                "codec": codec,
                "nbytes": len(raw),
                "size": len(payload),
            }
        )
        payloads.append(payload)
    header = {"v": PROTOCOL, "type": msg_type, **fields, "arrays": descriptors}
    return [msgpack.packb(header, use_bin_type=True), *payloads]


def decode(
    frames: Sequence[Any],
    *,
    max_array_bytes: int = DEFAULT_MAX_ARRAY_BYTES,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> Message:
    """Decodes frames (bytes, memoryviews or zmq.Frame) into a Message, or raises ProtocolError."""
    try:
        return _decode(list(frames), max_array_bytes, max_message_bytes)
    except ProtocolError:
        raise
    except Exception as e:  # any other failure is still the sender's malformed message
        raise ProtocolError(f"malformed message: {type(e).__name__}: {e}") from None


def peek_version(frame: Any) -> int | None:
    """The protocol version a header claims, or None: to reject a peer with a clear reason."""
    try:
        header = msgpack.unpackb(_buffer(frame), raw=False)
        version = header.get("v") if isinstance(header, dict) else None
        return version if isinstance(version, int) else None
    except Exception:
        return None


_PACK_COUNT = struct.Struct("<I")
_PACK_SIZE = struct.Struct("<Q")


def pack(frames: Sequence[bytes]) -> bytes:
    """Joins frames into one (for CONFLATE sockets): count, sizes, then the frames."""
    sizes = b"".join(_PACK_SIZE.pack(len(f)) for f in frames)
    return b"".join([_PACK_COUNT.pack(len(frames)), sizes, *frames])


def unpack(frame: Any) -> list[memoryview]:
    """Splits a packed frame into zero-copy views of its frames; raises ProtocolError."""
    view = memoryview(_buffer(frame)).cast("B")
    if len(view) < _PACK_COUNT.size:
        raise ProtocolError("packed message shorter than its frame count")
    (count,) = _PACK_COUNT.unpack_from(view)
    if count < 1 or count > MAX_ARRAYS + 1:
        raise ProtocolError(f"packed message claims {count} frames (1..{MAX_ARRAYS + 1} allowed)")
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


def _decode(frames: list[Any], max_array_bytes: int, max_message_bytes: int) -> Message:
    if not frames:
        raise ProtocolError("empty message: no header frame")
    header_bytes = _buffer(frames[0])
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(header_bytes)} bytes exceeds {MAX_HEADER_BYTES}")
    header = msgpack.unpackb(
        header_bytes,
        raw=False,
        strict_map_key=True,
        ext_hook=_reject_ext,
    )
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    version = header.pop("v", None)
    if version != PROTOCOL:
        raise ProtocolError(f"protocol version {version!r}, expected {PROTOCOL}: run the same apex version on both sides")
    msg_type = header.pop("type", None)
    if msg_type not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {msg_type!r}")
    descriptors = header.pop("arrays", None)
    _check_fields(msg_type, header)
    if not isinstance(descriptors, list):
        raise ProtocolError("header field 'arrays' must be a list")
    if descriptors and msg_type not in _ARRAYS_ALLOWED:
        raise ProtocolError(f"a {msg_type!r} message carries no arrays")
    if len(descriptors) > MAX_ARRAYS:
        raise ProtocolError(f"{len(descriptors)} arrays exceed the limit of {MAX_ARRAYS}")
    if len(descriptors) != len(frames) - 1:
        raise ProtocolError(f"header describes {len(descriptors)} arrays but {len(frames) - 1} frames follow")

    # Validate every descriptor and the total before decompressing or allocating anything.
    specs, names, total = [], set(), 0
    for i, (descriptor, frame) in enumerate(zip(descriptors, frames[1:])):
        spec = _check_descriptor(i, descriptor, max_array_bytes)
        if spec[0] in names:
            raise ProtocolError(f"array name {spec[0]!r} appears twice")
        names.add(spec[0])
        payload = _buffer(frame)
        if len(payload) != descriptor["size"]:
            raise ProtocolError(f"array {spec[0]!r}: frame has {len(payload)} bytes, header says {descriptor['size']}")
        if spec[3] == "raw" and descriptor["size"] != spec[4]:
            raise ProtocolError(f"array {spec[0]!r}: raw size {descriptor['size']} != nbytes {spec[4]}")
        total += spec[4]
        specs.append((*spec, payload))
    if total > max_message_bytes:
        raise ProtocolError(f"arrays total {total} bytes, over the cap of {max_message_bytes}")

    arrays = {}
    for name, dtype, shape, codec, nbytes, payload in specs:
        if codec == "lz4":
            try:
                data = lz4.block.decompress(payload, uncompressed_size=nbytes)
            except Exception as e:
                raise ProtocolError(f"array {name!r}: corrupt lz4 payload ({e})") from None
            if len(data) != nbytes:
                raise ProtocolError(f"array {name!r}: lz4 payload holds {len(data)} bytes, header says {nbytes}")
        else:
            data = payload
        array = np.frombuffer(data, dtype=dtype).reshape(shape)
        array.flags.writeable = False
        arrays[name] = array
    return Message(msg_type, header, arrays)


def _check_descriptor(i: int, d: Any, max_array_bytes: int) -> tuple:
    if not isinstance(d, dict):
        raise ProtocolError(f"array descriptor {i} must be a map")
    name, dtype, shape, codec = d.get("name"), d.get("dtype"), d.get("shape"), d.get("codec")
    nbytes, size = d.get("nbytes"), d.get("size")
    if not isinstance(name, str) or not name or len(name) > 128:
        raise ProtocolError(f"array descriptor {i}: name must be a non-empty string of at most 128 characters")
    if dtype not in DTYPES:
        raise ProtocolError(f"array {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if codec not in CODECS:
        raise ProtocolError(f"array {name!r}: codec {codec!r} is not one of {CODECS}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(type(n) is int and n >= 0 for n in shape):
        raise ProtocolError(f"array {name!r}: shape must be a list of at most {MAX_NDIM} non-negative integers")
    for key, value in (("nbytes", nbytes), ("size", size)):
        if type(value) is not int or value < 0:
            raise ProtocolError(f"array {name!r}: {key} must be a non-negative integer")
    if nbytes > max_array_bytes:
        raise ProtocolError(f"array {name!r}: {nbytes} bytes exceed the cap of {max_array_bytes}")
    dtype = np.dtype(dtype)
    expected = dtype.itemsize
    for n in shape:
        expected *= n
        if expected > max_array_bytes:
            raise ProtocolError(f"array {name!r}: shape {shape} exceeds the cap of {max_array_bytes} bytes")
    if expected != nbytes:
        raise ProtocolError(f"array {name!r}: shape {shape} of {dtype.str} is {expected} bytes, header says {nbytes}")
    return name, dtype, tuple(shape), codec, nbytes


def _check_fields(msg_type: str, fields: Mapping[str, Any]) -> None:
    expected = MESSAGE_TYPES.get(msg_type)
    if expected is None:
        raise ProtocolError(f"unknown message type {msg_type!r}, expected one of {sorted(MESSAGE_TYPES)}")
    missing = expected.keys() - fields.keys()
    extra = fields.keys() - expected.keys()
    if missing or extra:
        raise ProtocolError(f"{msg_type!r} header: missing fields {sorted(missing)}, unexpected {sorted(extra)}")
    for name, types in expected.items():
        value = fields[name]
        # bool is an int in Python; a protocol integer is not a bool.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise ProtocolError(f"{msg_type!r} header: field {name!r} must be {names}, got {type(value).__name__}")


def _buffer(frame: Any) -> Any:
    """The bytes-like content of a frame: zmq.Frame exposes it as ``.buffer``."""
    return frame.buffer if hasattr(frame, "buffer") else frame


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed in a header")
