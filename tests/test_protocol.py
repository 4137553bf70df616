"""apex.protocol: round trips, validation, and fuzzing that only ever raises ProtocolError."""

from __future__ import annotations

import tracemalloc

import lz4.block
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apex import protocol
from apex.errors import ProtocolError
from apex.protocol import DTYPES, MESSAGE_TYPES, decode, encode, pack, unpack

FUZZ_EXAMPLES = 2500  # per fuzz test; five of them: 12,500 malformed inputs a run

FIELDS = {
    "hello": {"actor_index": None, "num_envs": 16, "host": "node-3", "pid": 4242},
    "heartbeat": {"actor_index": 2},
    "welcome": {"actor_index": 2, "spec": {"env": {"id": "CartPole-v1"}, "eps": [0.4, 0.1]}},
    "reject": {"reason": "protocol mismatch"},
    "stop": {"reason": "stop-return reached"},
    "heartbeat_ack": {"weights_version": 17},
    "batch": {"actor_index": 1, "weights_version": 9, "info": {"episode_returns": [9.0, 21.0]}},
    "weights": {"version": 12},
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


def test_large_compressible_arrays_go_lz4_and_small_ones_raw():
    frames = encode("batch", FIELDS["batch"], {"frames": np.zeros((10, 84, 84), np.uint8), "a": np.arange(4)})
    descriptors = msgpack.unpackb(frames[0])["arrays"]
    assert [d["codec"] for d in descriptors] == ["lz4", "raw"]
    assert len(frames[1]) < 10 * 84 * 84 // 10


def test_decoded_arrays_are_read_only_views():
    frames = encode("batch", FIELDS["batch"], cartpole_arrays())
    msg = decode([memoryview(f) for f in frames])
    for array in msg.arrays.values():
        assert not array.flags.writeable
    action_frame = list(cartpole_arrays()).index("action") + 1
    assert np.shares_memory(msg.arrays["action"], np.frombuffer(frames[action_frame], np.uint8))


def test_encode_snapshots_arrays():
    """Changing an array after encode must not change what was sent (no torn weights)."""
    weights = np.zeros(10_000, np.float32)
    frames = encode("weights", {"version": 1}, {"w": weights}, compress=False)
    weights[:] = 1.0
    assert decode(frames).arrays["w"].max() == 0.0


def test_pack_round_trip_and_validation():
    frames = encode("weights", {"version": 3}, {"w": np.arange(100, dtype=np.float32)})
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
    return msgpack.unpackb(frames[0])


def _with_header(frames, header):
    return [msgpack.packb(header), *frames[1:]]


def _valid_batch():
    return encode("batch", FIELDS["batch"], {"obs": np.zeros((64, 84, 84), np.uint8), "a": np.arange(64)})


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda h: h.update(v=2), "protocol version 2"),
        (lambda h: h.pop("v"), "protocol version None"),
        (lambda h: h.update(type="batchx"), "unknown message type"),
        (lambda h: h["arrays"][0].update(dtype="|O"), "dtype"),
        (lambda h: h["arrays"][0].update(dtype="<c8"), "dtype"),
        (lambda h: h["arrays"][0].update(codec="zstd"), "codec"),
        (lambda h: h["arrays"][0].update(shape=[64, 84, 85]), "header says"),
        (lambda h: h["arrays"][0].update(shape=[2**40, 2**40]), "exceeds the cap"),
        (lambda h: h["arrays"][0].update(shape=[-1, 84, 84]), "non-negative"),
        (lambda h: h["arrays"][0].update(shape=[1] * 9), "at most 8"),
        (lambda h: h["arrays"][0].update(nbytes=2**62, shape=[2**62]), "cap"),
        (lambda h: h["arrays"][0].update(size=3), "frame has"),
        (lambda h: h["arrays"][1].update(name="obs"), "appears twice"),
        (lambda h: h["arrays"].pop(), "describes 1 arrays but 2 frames"),
        (lambda h: h.update(arrays="x"), "must be a list"),
        (lambda h: h.update(actor_index="1"), "must be int"),
    ],
)
def test_decode_rejects_malformed_headers(mutate, message):
    frames = _valid_batch()
    header = _header(frames)
    mutate(header)
    with pytest.raises(ProtocolError, match=message):
        decode(_with_header(frames, header))


def test_decode_rejects_lz4_payload_of_the_wrong_size():
    frames = _valid_batch()
    header = _header(frames)
    short = lz4.block.compress(np.zeros(1000, np.uint8).tobytes(), store_size=False)
    header["arrays"][0]["size"] = len(short)
    with pytest.raises(ProtocolError, match="lz4"):
        decode([msgpack.packb(header), short, frames[2]])


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
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=FUZZ_EXAMPLES)
@given(st.data())
def test_fuzz_header_fields_of_wrong_types(data):
    frames = _valid_batch()
    header = _header(frames)
    target = data.draw(st.sampled_from(["top", "descriptor"]))
    if target == "top":
        key = data.draw(st.sampled_from(["v", "type", "actor_index", "weights_version", "info", "arrays", "new"]))
        header[key] = data.draw(_json_like)
    else:
        descriptor = header["arrays"][data.draw(st.integers(0, 1))]
        key = data.draw(st.sampled_from(["name", "dtype", "shape", "codec", "nbytes", "size"]))
        descriptor[key] = data.draw(_json_like)
    _decode_only_protocol_errors(_with_header(frames, header))


@settings(max_examples=FUZZ_EXAMPLES)
@given(
    shape=st.lists(st.integers(0, 2**63 - 1), max_size=8),
    nbytes=st.integers(0, 2**64 - 1),
    dtype=st.sampled_from(sorted(DTYPES)),
    payload=st.binary(max_size=64),
)
def test_fuzz_huge_declared_sizes_never_allocate(shape, nbytes, dtype, payload):
    header = {"v": 1, "type": "batch", **FIELDS["batch"], "arrays": [
        {"name": "x", "dtype": dtype, "shape": shape, "codec": "lz4", "nbytes": nbytes, "size": len(payload)}
    ]}
    tracemalloc.start()
    try:
        _decode_only_protocol_errors([msgpack.packb(header), payload], max_array_bytes=1 << 20, max_message_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20  # never more than the 1 MiB cap, plus change


@settings(max_examples=FUZZ_EXAMPLES)
@given(st.data())
def test_fuzz_corrupt_lz4(data):
    frames = _valid_batch()
    payload = bytearray(frames[1])
    for _ in range(data.draw(st.integers(1, 6))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        payload = payload[: data.draw(st.integers(0, len(payload)))]
        header = _header(frames)
        header["arrays"][0]["size"] = len(payload)
        frames = _with_header(frames, header)
    try:
        msg = decode([frames[0], bytes(payload), frames[2]])
    except ProtocolError:
        return
    assert msg.arrays["obs"].shape == (64, 84, 84)  # a flip lz4 cannot see still decodes to the declared size
