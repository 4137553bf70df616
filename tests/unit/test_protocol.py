"""apex.wire.protocol: round trips, validation, and fuzzing that only ever raises ProtocolError."""

from __future__ import annotations

import tracemalloc

import lz4.block
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apex.errors import ProtocolError
from apex.wire import protocol
from apex.wire.protocol import DTYPES, MESSAGE_TYPES, PROTOCOL, decode, encode, pack, unpack

FUZZ_EXAMPLES = 2500  # per fuzz test; five of them: 12,500 malformed inputs a run

FIELDS = {
    "hello": {"actor_index": None, "num_envs": 16, "host": "node-3", "pid": 4242},
    "heartbeat": {"actor_index": 2},
    "welcome": {
        "actor_index": 2,
        "setup": {"env": {"id": "CartPole-v1"}, "eps": [0.4, 0.1]},
        "session": b"s" * 16,
        "incarnation": b"i" * 8,
    },
    "reject": {"reason": "protocol mismatch", "retry": False},
    "stop": {"reason": "stop-return reached"},
    "heartbeat_ack": {"weights_version": 17},
    "batch": {
        "actor_index": 1,
        "weights_version": 9,
        "info": {"episode_returns": [9.0, 21.0]},
        "session": b"s" * 16,
        "seq": 3,
    },
    "weights": {"version": 12, "incarnation": b"i" * 8},
}


def cartpole_arrays(n: int = 256) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "obs": rng.standard_normal((n, 4)).astype(np.float32),
        "action": rng.integers(0, 2, n),
        "reward": np.ones(n, np.float32),
        "discount": np.full(n, 0.99**3, np.float32),
        "next_obs": rng.standard_normal((n, 4)).astype(np.float32),
        "priority": rng.random(n).astype(np.float32),
    }


def test_every_message_type_has_a_round_trip_case():
    assert FIELDS.keys() == MESSAGE_TYPES.keys()


@pytest.mark.parametrize("msg_type", sorted(MESSAGE_TYPES))
def test_round_trip_every_message_type(msg_type):
    arrays = cartpole_arrays(8) if msg_type in ("batch", "weights") else None
    msg = decode(encode(msg_type, FIELDS[msg_type], arrays))
    assert msg.type == msg_type
    assert msg.fields == FIELDS[msg_type]
    for name, array in (arrays or {}).items():
        np.testing.assert_array_equal(msg.arrays[name], array)
        assert msg.arrays[name].dtype == array.dtype


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 0, 4), (64, 84, 84)])
def test_round_trip_every_dtype_and_shape(dtype, shape):
    rng = np.random.default_rng(1)
    array = (rng.random(shape) * 100).astype(dtype)
    for compress in (True, False):
        msg = decode(encode("batch", FIELDS["batch"], {"x": array}, compress=compress))
        np.testing.assert_array_equal(msg.arrays["x"], array)
        assert msg.arrays["x"].shape == shape and msg.arrays["x"].dtype == array.dtype


def layout_of(frames):
    return msgpack.unpackb(protocol.header_of(frames)["layout"])


def raw_region(frames):
    """Frame 0's raw arrays, after the prefix, the header and its padding."""
    return np.frombuffer(protocol.split_head(frames[0])[1], np.uint8)


def test_large_compressible_arrays_go_lz4_and_small_ones_share_the_raw_frame():
    frames = encode(
        "batch",
        FIELDS["batch"],
        {"frames": np.zeros((10, 84, 84), np.uint8), "a": np.arange(3, dtype=np.int16), "b": np.ones(5)},
    )
    assert [entry[3] for entry in layout_of(frames)] == ["lz4", "raw", "raw"]
    assert len(frames) == 2  # the header with the raw arrays after it, the lz4 array
    assert len(raw_region(frames)) == 8 + 40  # int16[3] padded to 8 bytes, then float64[5]
    assert len(frames[1]) < 10 * 84 * 84 // 10


def test_cartpole_batch_is_one_frame_and_protocol_3_peers_hear_the_version():
    frames = encode("batch", FIELDS["batch"], cartpole_arrays())
    assert len(frames) == 1 and bytes(frames[0][:4]) == protocol.MAGIC
    old = msgpack.packb({"v": 3, "type": "hello", **FIELDS["hello"], "layout": msgpack.packb([])})
    assert protocol.peek_version(old) == 3
    with pytest.raises(ProtocolError, match="protocol version 3, expected 4"):
        decode([old])


def test_decoded_arrays_are_read_only_views():
    frames = encode("batch", FIELDS["batch"], cartpole_arrays())
    msg = decode([memoryview(f) for f in frames])
    for array in msg.arrays.values():
        assert not array.flags.writeable
        assert array.ctypes.data % array.dtype.itemsize == 0  # aligned
    raw_frame = np.frombuffer(frames[0], np.uint8)
    assert all(np.shares_memory(msg.arrays[name], raw_frame) for name in ("action", "reward", "priority"))


def test_encode_snapshots_arrays():
    """Changing an array after encode must not change what was sent (no torn weights)."""
    weights = np.zeros(10_000, np.float32)
    frames = encode("weights", FIELDS["weights"], {"w": weights}, compress=False)
    weights[:] = 1.0
    assert decode(frames).arrays["w"].max() == 0.0


def test_pack_round_trip_and_validation():
    frames = encode("weights", {**FIELDS["weights"], "version": 3}, {"w": np.arange(100, dtype=np.float32)})
    msg = decode(unpack(pack(frames)))
    assert msg.fields["version"] == 3
    packed = pack(frames)
    for bad in (b"", packed[:3], packed[:-1], packed + b"x", b"\x00\x00\x00\x00", b"\xff\xff\xff\xff" + packed[4:]):
        with pytest.raises(ProtocolError):
            unpack(bad)


@pytest.mark.parametrize(
    "msg_type, fields, arrays, message",
    [
        ("nope", {}, None, "unknown message type"),
        ("hello", {"actor_index": None}, None, "missing fields"),
        ("reject", {"reason": "x", "extra": 1}, None, "unexpected"),
        ("heartbeat_ack", {"weights_version": "7"}, None, "must be int"),
        ("heartbeat_ack", {"weights_version": True}, None, "must be int"),
        ("stop", {"reason": "x"}, {"a": np.zeros(1)}, "carries no arrays"),
        ("batch", FIELDS["batch"], {"a": np.array(["s"])}, "dtype"),
        ("batch", FIELDS["batch"], {"a": np.zeros(2, ">f4")}, "dtype"),
        ("batch", FIELDS["batch"], {"a": np.zeros(2, np.complex64)}, "dtype"),
    ],
)
def test_encode_refuses_what_decode_would_refuse(msg_type, fields, arrays, message):
    with pytest.raises(ProtocolError, match=message):
        encode(msg_type, fields, arrays)


def _header(frames):
    return protocol.header_of(frames)


def _with_header(frames, header):
    return protocol.with_header(frames, header)


def _with_layout(frames, layout):
    header = _header(frames)
    header["layout"] = msgpack.packb(layout)
    return _with_header(frames, header)


def _valid_batch():
    return encode("batch", FIELDS["batch"], {"obs": np.zeros((64, 84, 84), np.uint8), "a": np.arange(64)})


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda h: h.update(v=PROTOCOL + 1), f"protocol version {PROTOCOL + 1}"),
        (lambda h: h.pop("v"), "protocol version None"),
        (lambda h: h.update(type="batchx"), "unknown message type"),
        (lambda h: h.update(layout="x"), "must be msgpack bytes"),
        (lambda h: h.update(layout=msgpack.packb({"a": 1})), "must be a list"),
        (lambda h: h.update(actor_index="1"), "must be int"),
        (lambda h: h.update(extra=1), "unexpected"),
    ],
)
def test_decode_rejects_malformed_headers(mutate, message):
    frames = _valid_batch()
    header = _header(frames)
    mutate(header)
    with pytest.raises(ProtocolError, match=message):
        decode(_with_header(frames, header))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda layout: layout[0].__setitem__(1, "|O"), "dtype"),
        (lambda layout: layout[0].__setitem__(1, "<c8"), "dtype"),
        (lambda layout: layout[0].__setitem__(3, "zstd"), "codec"),
        (lambda layout: layout[0].__setitem__(2, [64, 84, 85]), "lz4 payload holds"),
        (lambda layout: layout[1].__setitem__(2, [65]), "raw arrays take"),
        (lambda layout: layout[0].__setitem__(2, [2**40, 2**40]), "exceeds the cap"),
        (lambda layout: layout[0].__setitem__(2, [-1, 84, 84]), "non-negative"),
        (lambda layout: layout[0].__setitem__(2, [1] * 9), "at most 8"),
        (lambda layout: layout[1].__setitem__(0, "obs"), "appears twice"),
        (lambda layout: layout.pop(), "raw arrays take"),
        (lambda layout: layout.insert(0, ["c", "|u1", [2], "lz4"]), "layout needs 3 frames, message has 2"),
        (lambda layout: layout.append(["c", "<f4", [2], "raw"]), "raw arrays take"),
        (lambda layout: layout[0].pop(), "must be \\[name, dtype, shape, codec\\]"),
        (lambda layout: layout[1].__setitem__(0, ""), "non-empty string"),
    ],
)
def test_decode_rejects_malformed_layouts(mutate, message):
    frames = _valid_batch()
    layout = layout_of(frames)
    mutate(layout)
    with pytest.raises(ProtocolError, match=message):
        decode(_with_layout(frames, layout))


def test_decode_rejects_missing_or_extra_frames():
    frames = _valid_batch()
    with pytest.raises(ProtocolError, match="frames"):
        decode(frames[:1])
    with pytest.raises(ProtocolError, match="frames"):
        decode([*frames, b"extra"])


def test_decode_rejects_lz4_payload_of_the_wrong_size():
    frames = _valid_batch()
    short = lz4.block.compress(np.zeros(1000, np.uint8).tobytes(), store_size=False)
    with pytest.raises(ProtocolError, match="lz4"):
        decode([frames[0], short])


def test_a_cached_layout_is_still_checked_against_the_frames():
    frames = _valid_batch()
    decode(frames)  # the layout is cached now
    with pytest.raises(ProtocolError, match="raw arrays take"):
        decode([frames[0][:-8], frames[1]])


def test_decode_caps_are_applied():
    frames = encode("batch", FIELDS["batch"], {"a": np.zeros(1000, np.uint8)})
    with pytest.raises(ProtocolError, match="cap"):
        decode(frames, max_array_bytes=999)
    with pytest.raises(ProtocolError, match="cap"):
        decode(frames, max_message_bytes=999)
    assert decode(frames, max_array_bytes=1000).arrays["a"].nbytes == 1000


def test_peek_version():
    frames = encode("hello", FIELDS["hello"])
    assert protocol.peek_version(frames[0]) == protocol.PROTOCOL
    assert protocol.peek_version(msgpack.packb({"v": 7})) == 7
    assert protocol.peek_version(b"\xc1garbage") is None
    assert protocol.peek_version(protocol.MAGIC + b"\xff\xff\xff\x7f") is None  # a header longer than the frame


# --- fuzzing: anything malformed raises ProtocolError and nothing else


def _decode_only_protocol_errors(frames, **caps):
    try:
        decode(frames, **caps)
    except ProtocolError:
        pass


@settings(max_examples=FUZZ_EXAMPLES)
@given(st.lists(st.binary(max_size=300), max_size=5))
def test_fuzz_random_frames(frames):
    _decode_only_protocol_errors(frames)


@settings(max_examples=FUZZ_EXAMPLES)
@given(st.data())
def test_fuzz_truncated_and_flipped_frames(data):
    frames = [bytearray(f) for f in _valid_batch()]
    frame = data.draw(st.integers(0, len(frames) - 1))
    if data.draw(st.booleans()) and frames[frame]:
        cut = data.draw(st.integers(0, len(frames[frame]) - 1))
        frames[frame] = frames[frame][:cut]
    else:
        for _ in range(data.draw(st.integers(1, 8))):
            if frames[frame]:
                at = data.draw(st.integers(0, len(frames[frame]) - 1))
                frames[frame][at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        frames = frames[: data.draw(st.integers(0, len(frames)))]
    _decode_only_protocol_errors([bytes(f) for f in frames])


_json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=FUZZ_EXAMPLES)
@given(st.data())
def test_fuzz_header_fields_of_wrong_types(data):
    frames = _valid_batch()
    if data.draw(st.booleans()):
        header = _header(frames)
        key = data.draw(st.sampled_from(["v", "type", "actor_index", "weights_version", "info", "layout", "new"]))
        header[key] = data.draw(_json_like)
        frames = _with_header(frames, header)
    else:
        layout = layout_of(frames)
        entry = layout[data.draw(st.integers(0, 1))]
        entry[data.draw(st.integers(0, 3))] = data.draw(_json_like)
        frames = _with_layout(frames, layout)
    _decode_only_protocol_errors(frames)


@settings(max_examples=FUZZ_EXAMPLES)
@given(
    shape=st.lists(st.integers(0, 2**63 - 1), max_size=8),
    dtype=st.sampled_from(sorted(DTYPES)),
    codec=st.sampled_from(["raw", "lz4"]),
    payload=st.binary(max_size=64),
)
def test_fuzz_huge_declared_sizes_never_allocate(shape, dtype, codec, payload):
    layout = msgpack.packb([["x", dtype, shape, codec]])
    header = {"v": PROTOCOL, "type": "batch", **FIELDS["batch"], "layout": layout}
    tracemalloc.start()
    try:
        head = protocol.with_header(encode("batch", FIELDS["batch"]), header)[0]
        frames = [head + payload] if codec == "raw" else [head, payload]
        _decode_only_protocol_errors(frames, max_array_bytes=1 << 20, max_message_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20  # never more than the 1 MiB cap, plus change


@settings(max_examples=FUZZ_EXAMPLES)
@given(st.data())
def test_fuzz_corrupt_lz4(data):
    frames = _valid_batch()
    payload = bytearray(frames[1])  # the lz4 frame
    for _ in range(data.draw(st.integers(1, 6))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        payload = payload[: data.draw(st.integers(0, len(payload)))]
    try:
        msg = decode([frames[0], bytes(payload)])
    except ProtocolError:
        return
    assert msg.arrays["obs"].shape == (64, 84, 84)  # a flip lz4 cannot see still decodes to the declared size


def test_lazy_decode_leaves_lz4_arrays_for_decompress_into():
    frames = _valid_batch()
    msg = decode(frames, lazy=True)
    compressed = msg.arrays["obs"]
    assert isinstance(compressed, protocol.Compressed) and compressed.shape == (64, 84, 84)
    assert isinstance(msg.arrays["a"], np.ndarray)  # raw arrays are views as usual
    out = np.full(compressed.shape, 7, np.uint8)
    compressed.decompress_into(out)
    np.testing.assert_array_equal(out, decode(frames).arrays["obs"])
    corrupt = protocol.Compressed("obs", compressed.dtype, compressed.shape, bytes(compressed.payload)[:-3])
    with pytest.raises(ProtocolError, match="corrupt lz4"):
        corrupt.decompress_into(out)
    with pytest.raises(ValueError, match="C-contiguous"):
        compressed.decompress_into(np.zeros((64, 84, 85), np.uint8)[:, :, :84])
