"""Frames round-trip, and every malformed frame is a ProtocolError, never anything else."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import typing
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.protocol.messages import (
    DTYPES,
    MAX_BATCH,
    MAX_DIMS,
    Admit,
    Assign,
    BatchEntry,
    BatchResult,
    Built,
    Challenge,
    Done,
    Error,
    Fingerprint,
    Forward,
    ForwardBatch,
    GetStats,
    Hello,
    Message,
    Offer,
    Probe,
    Reset,
    Result,
    Stats,
    Tensor,
    Welcome,
)
from workers.protocol.report import LayerRange, NodeReport
from workers.protocol.wire import (
    MAX_HEADER,
    PREFIX,
    FrameSocket,
    ProtocolError,
    check_prefix,
    encode_frame,
    pack_tensor,
    read_frame,
    unpack_tensor,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REPORT = NodeReport(
    addr="127.0.0.1:40123",
    layers=LayerRange(start=0, end=10),
    device="cpu",
    precision="f32",
    build_ms=1234,
    resident_bytes=123456789,
    n_params=45000000,
)
GGUF_PRINT = Fingerprint("gguf", "SmolLM2-135M-Instruct.Q4_1.gguf", 91_000_000, "ab" * 32)
ARRAYS = [
    np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5,
    np.array([[0.5, -1.0], [65504.0, np.inf]], dtype=np.float16),
    np.array([-(2**31), 0, 2**31 - 1], dtype=np.int32),
    np.array(3.25, dtype=np.float32),  # a scalar: shape []
    np.zeros((0, 4), dtype=np.float16),  # no elements, no payload bytes
    np.arange(2 * 3 * 1 * 2, dtype=np.int32).reshape(2, 3, 1, 2),  # MAX_DIMS
]


def frame(msg, payload: bytes | memoryview = b"") -> bytes:
    return b"".join(encode_frame(msg, payload))


def tensor_frames() -> list[tuple[Message, bytes]]:
    """A Forward and a Result for every array above (so every allowed dtype)."""
    frames = []
    for i, array in enumerate(ARRAYS):
        tensor, payload = pack_tensor(array)
        frames.append(
            (
                Forward(id=i, session=f"run-{i}", start_pos=i * 7, tensor=tensor, last_only=i % 2 == 0),
                bytes(payload),
            )
        )
        frames.append((Result(id=i, compute_ms=1.5 * i, tensor=tensor), bytes(payload)))
    return frames + batch_frames()


def batch_frames() -> list[tuple[Message, bytes]]:
    """A ForwardBatch of three sessions' rows, and its BatchResult with one last row each."""
    rows = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    tensor, payload = pack_tensor(rows)
    entries = [BatchEntry("a", 0, 3), BatchEntry("b", 17, 1, last_only=True), BatchEntry("c", 2**31 - 1, 2)]
    last, last_payload = pack_tensor(rows[[2, 3, 5]])
    return [
        (ForwardBatch(id=9, entries=entries, tensor=tensor), bytes(payload)),
        (BatchResult(id=9, compute_ms=2.5, rows=[1, 1, 1], tensor=last), bytes(last_payload)),
        (Probe(id=2, tensor=Tensor("float32", [3])), bytes(12)),
    ]


def plain_frames() -> list[tuple[Message, bytes]]:
    """One message of every kind that carries no payload."""
    return [
        (Challenge(nonce=bytes(range(16))), b""),
        (Challenge(nonce=b"\xff" * 64, version=2), b""),
        (Hello(mac=b"m" * 32, nonce=b"n" * 16), b""),
        (Welcome(mac=b"w" * 32, report=REPORT), b""),
        (Reset(id=2**63 - 1, session="a" * 128), b""),
        (Done(id=0), b""),
        (GetStats(id=5), b""),
        (Stats(id=5, resident_bytes=10**12, sessions=3, forwards=99), b""),
        (
            Stats(
                id=5,
                resident_bytes=10**9,
                sessions=2,
                forwards=9,
                kv_bytes=3,
                kv_session_bytes={"a": 1, "b": 2},
            ),
            b"",
        ),
        (Error(id=0, message="stage 2 failed: ünïcode is fine"), b""),
        (Admit(mac=b"a" * 32), b""),
        (Admit(mac=b"a" * 32, model="/models/SmolLM2-135M-Instruct.Q4_1.gguf", precision="packed"), b""),
        (
            Offer(
                addr="10.0.0.2:40123",
                model="smollm2",
                fingerprint=GGUF_PRINT,
                precision="f32",
                memory_bytes=2**34,
                cores=4,
                pid=77,
            ),
            b"",
        ),
        (
            Offer(
                addr="[::1]:1",
                model="fake:layers=4",
                fingerprint=Fingerprint("spec", "fake:layers=4"),
                precision="f16",
                memory_bytes=0,
                cores=1,
            ),
            b"",
        ),
        (
            Offer(
                addr="10.0.0.3:7000",
                model="gemma3",
                fingerprint=GGUF_PRINT,
                precision="packed",
                memory_bytes=2**30,
                cores=2,
                layer_ms=[0.41] * 17 + [15.5],
                stage_ms=0.1,
                calibration="sampled, kept on this host",
                probes=True,
            ),
            b"",
        ),
        (Assign(layers=LayerRange(10, 20)), b""),
        (Built(report=REPORT), b""),
    ]


ALL_FRAMES = plain_frames() + tensor_frames()
ENCODED = [frame(msg, payload) for msg, payload in ALL_FRAMES]


async def reader_of(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def read_one(data: bytes) -> tuple[Message, bytes] | None:
    """The first frame of `data`, read by read_frame from a stream holding just those bytes."""
    return await asyncio.wait_for(read_frame(await reader_of(data)), 2)


def decode_only_protocol_errors(data: bytes) -> tuple[Message, bytes] | None:
    """Read one frame in a loop of its own, allowing success or ProtocolError and nothing else."""
    try:
        return asyncio.run(read_one(data))
    except ProtocolError:
        return None


async def read_all(data: bytes) -> list[tuple[Message, bytes]]:
    reader = await reader_of(data)
    frames = []
    while (got := await asyncio.wait_for(read_frame(reader), 2)) is not None:
        frames.append(got)
    return frames


def test_the_examples_cover_every_message_kind_in_the_union():
    kinds = set(typing.get_args(Message))
    assert {type(msg) for msg, _ in ALL_FRAMES} == kinds
    assert set(DTYPES) == {t.dtype for msg, _ in tensor_frames() for t in [msg.tensor]}


@pytest.mark.parametrize(("msg", "payload"), ALL_FRAMES, ids=lambda v: type(v).__name__)
async def test_every_message_kind_round_trips_through_a_frame(msg, payload):
    [(decoded, got_payload)] = await read_all(frame(msg, payload))
    assert decoded == msg
    assert type(decoded) is type(msg)
    assert bytes(got_payload) == payload


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype}{list(a.shape)}")
async def test_a_tensor_of_each_allowed_dtype_comes_back_as_an_equal_array(array):
    tensor, payload = pack_tensor(array)
    [(msg, got)] = await read_all(frame(Forward(id=1, session="s", start_pos=0, tensor=tensor), payload))
    back = unpack_tensor(msg.tensor, got)
    assert back.dtype == array.dtype
    assert back.shape == array.shape
    np.testing.assert_array_equal(back, array)


async def test_a_non_contiguous_array_is_packed_by_value():
    array = np.arange(12, dtype=np.float32).reshape(3, 4).T
    tensor, payload = pack_tensor(array)
    [(msg, got)] = await read_all(frame(Result(id=1, compute_ms=0.0, tensor=tensor), payload))
    np.testing.assert_array_equal(unpack_tensor(msg.tensor, got), array)


@pytest.mark.parametrize("dtype", ["float64", "int64", "uint8", "bool", "complex64"])
def test_pack_tensor_refuses_a_dtype_outside_the_allow_list(dtype):
    with pytest.raises(ProtocolError, match=dtype):
        pack_tensor(np.zeros(3, dtype=dtype))


async def test_read_frame_over_a_stream_gives_every_frame_in_order_then_none_at_eof():
    frames = await read_all(b"".join(ENCODED))
    assert [msg for msg, _ in frames] == [msg for msg, _ in ALL_FRAMES]
    assert [bytes(p) for _, p in frames] == [p for _, p in ALL_FRAMES]


async def test_read_frame_returns_none_on_a_clean_end_of_stream():
    assert await asyncio.wait_for(read_frame(await reader_of(b"")), 2) is None


async def test_read_frame_is_indifferent_to_which_side_a_message_belongs_to():
    # Direction and order are the server's business, not the framing's.
    order = [ALL_FRAMES[-1], ALL_FRAMES[3], ALL_FRAMES[0]]
    frames = await read_all(b"".join(frame(m, p) for m, p in order))
    assert [m for m, _ in frames] == [m for m, _ in order]


async def test_every_truncation_of_a_valid_frame_is_a_protocol_error_from_read_frame():
    for data in ENCODED:
        for cut in range(1, len(data)):
            with pytest.raises(ProtocolError):
                await asyncio.wait_for(read_frame(await reader_of(data[:cut])), 2)


async def test_a_stray_byte_after_a_frame_is_a_protocol_error_once_the_frame_is_read():
    reader = await reader_of(ENCODED[0] + b"\0")
    assert await asyncio.wait_for(read_frame(reader), 2) == ALL_FRAMES[0]
    with pytest.raises(ProtocolError, match=r"truncated frame prefix \(1 bytes\)"):
        await asyncio.wait_for(read_frame(reader), 2)


@pytest.mark.parametrize(
    ("header_len", "payload_len"),
    [(1, 2**32 - 1), (2**32 - 1, 0), (MAX_HEADER + 1, 0), (0, 0), (0, 10)],
)
def test_check_prefix_refuses_lengths_outside_the_limits(header_len, payload_len):
    with pytest.raises(ProtocolError):
        check_prefix(PREFIX.pack(header_len, payload_len))


def test_check_prefix_accepts_lengths_at_the_limits():
    assert check_prefix(PREFIX.pack(MAX_HEADER, 1000), max_payload=1000) == (MAX_HEADER, 1000)
    with pytest.raises(ProtocolError, match="1001"):
        check_prefix(PREFIX.pack(10, 1001), max_payload=1000)


@pytest.mark.parametrize(
    ("header_len", "payload_len"),
    [(10, 2**32 - 1), (2**32 - 1, 0), (MAX_HEADER + 1, 0), (0, 0), (10, 256 * 1024 * 1024 + 1)],
)
async def test_an_oversized_prefix_is_refused_before_anything_more_is_read(header_len, payload_len):
    # Only the prefix arrives and the stream stays open: if read_frame tried
    # to read (or wait for) the announced bytes, it would hang here.
    reader = await reader_of(PREFIX.pack(header_len, payload_len), eof=False)
    with pytest.raises(ProtocolError):
        await asyncio.wait_for(read_frame(reader), 2)


async def test_a_refused_prefix_leaves_the_bytes_after_it_unread():
    reader = await reader_of(PREFIX.pack(10, 2**32 - 1) + b"0123456789", eof=False)
    with pytest.raises(ProtocolError, match="exceeds"):
        await asyncio.wait_for(read_frame(reader), 2)
    assert await asyncio.wait_for(reader.read(100), 2) == b"0123456789"


async def test_read_frame_honours_a_smaller_payload_limit():
    tensor, payload = pack_tensor(np.zeros(100, dtype=np.float32))
    data = frame(Result(id=1, compute_ms=0.0, tensor=tensor), payload)
    with pytest.raises(ProtocolError, match="exceeds"):
        await asyncio.wait_for(read_frame(await reader_of(data), max_payload=399), 2)
    _msg, got = await asyncio.wait_for(read_frame(await reader_of(data), max_payload=400), 2)
    assert len(got) == 400


def test_encode_frame_refuses_a_header_over_the_limit():
    with pytest.raises(ProtocolError, match="exceeds"):
        encode_frame(Error(id=1, message="x" * (MAX_HEADER + 1)))


def forward(tensor: Tensor, **changes) -> Forward:
    fields = dict(id=1, session="s", start_pos=0, tensor=tensor)
    fields.update(changes)
    return Forward(**fields)


@pytest.mark.parametrize("dtype", ["object", "float64", "int64", "uint8", "<f4", "f4", ""])
async def test_a_dtype_outside_the_allow_list_is_a_protocol_error(dtype):
    for msg in (
        forward(Tensor(dtype=dtype, shape=[2])),
        Result(id=1, compute_ms=0.0, tensor=Tensor(dtype=dtype, shape=[2])),
    ):
        with pytest.raises(ProtocolError, match="not allowed"):
            await read_one(frame(msg, b"\0" * 8))


@pytest.mark.parametrize(
    ("shape", "dtype", "n_bytes"),
    [
        ([2, 3], "float32", 23),
        ([2, 3], "float32", 25),
        ([2, 3], "float32", 0),
        ([4], "float16", 4),
        ([], "int32", 0),
        ([0], "int32", 4),
    ],
)
async def test_a_payload_whose_length_is_not_shape_times_itemsize_is_a_protocol_error(shape, dtype, n_bytes):
    with pytest.raises(ProtocolError, match="needs"):
        await read_one(frame(forward(Tensor(dtype=dtype, shape=shape)), b"\1" * n_bytes))


@pytest.mark.parametrize(("msg", "_"), plain_frames(), ids=lambda v: type(v).__name__)
async def test_a_payload_on_a_message_that_carries_none_is_a_protocol_error(msg, _):
    with pytest.raises(ProtocolError, match="carries no payload"):
        await read_one(frame(msg, b"\0\0\0\0"))


async def test_read_frame_checks_the_payload_too():
    with pytest.raises(ProtocolError, match="carries no payload"):
        await asyncio.wait_for(read_frame(await reader_of(frame(Done(id=1), b"xyz"))), 2)
    with pytest.raises(ProtocolError, match="not allowed"):
        await asyncio.wait_for(
            read_frame(await reader_of(frame(forward(Tensor("float64", [1])), b"\0" * 8))), 2
        )


T = Tensor(dtype="float32", shape=[1])


@pytest.mark.parametrize(
    "msg",
    [
        Done(id=-1),
        Done(id=2**63),
        GetStats(id=-(2**63)),
        Reset(id=1, session=""),
        Reset(id=1, session="a" * 129),
        Reset(id=1, session="a b"),
        Reset(id=1, session="../etc"),
        Reset(id=1, session="run\n1"),
        Reset(id=1, session="rün"),
        forward(T, session="a;b"),
        forward(T, id=-5),
        forward(T, start_pos=-1),
        forward(T, start_pos=2**31),
        forward(Tensor(dtype="float32", shape=[1, 1, 1, 1, 1])),
        forward(Tensor(dtype="float32", shape=[-1])),
        forward(Tensor(dtype="float32", shape=[2**31])),
        Challenge(nonce=b"short"),
        Challenge(nonce=b"x" * 65),
        Hello(mac=b"m" * 31, nonce=b"n" * 16),
        Welcome(mac=b"w" * 33, report=REPORT),
        Stats(id=1, resident_bytes=1, sessions=1, forwards=1, kv_bytes=-1),
        Stats(id=1, resident_bytes=1, sessions=1, forwards=1, kv_session_bytes={"a b": 1}),
        Stats(id=1, resident_bytes=1, sessions=1, forwards=1, kv_session_bytes={"a": -1}),
    ],
    ids=repr,
)
async def test_a_header_with_a_field_out_of_range_is_a_protocol_error(msg):
    with pytest.raises(ProtocolError, match="bad header"):
        await read_one(frame(msg, b"\0" * 4 if hasattr(msg, "tensor") else b""))


async def test_the_limits_are_inclusive():
    ok = [
        Done(id=2**63 - 1),
        Reset(id=0, session="a" * 128),
        Reset(id=0, session="Run_1.a:b-c"),
        forward(T, start_pos=2**31 - 1),
        forward(Tensor(dtype="float32", shape=[1] * MAX_DIMS)),
    ]
    for msg in ok:
        [(got, _)] = await read_all(frame(msg, b"\0" * 4 if hasattr(msg, "tensor") else b""))
        assert got == msg


def raw_frame(header: dict | list | bytes, payload: bytes = b"") -> bytes:
    if not isinstance(header, bytes):
        header = msgspec.msgpack.encode(header)
    return PREFIX.pack(len(header), len(payload)) + header + payload


@pytest.mark.parametrize(
    "header",
    [
        {"type": "nonsense", "id": 1},
        {"id": 1},
        {"type": "done"},
        {"type": "done", "id": "1"},
        {"type": "welcome", "mac": b"w" * 32, "report": {"addr": "a:1"}},
        {
            "type": "welcome",
            "mac": b"w" * 32,
            "report": {**msgspec.to_builtins(REPORT), "layers": {"start": 9, "end": 1}},
        },
        [1, 2, 3],
        b"\xc1",  # a byte msgpack never uses
        b"\x92\x01",  # an array cut short
        b"\x81\xa4type" + b"\x91" * 10_000 + b"\xc0",
        b"\x82\xa4type\xa4done\xa1x" + b"\x91" * 60_000 + b"\xc0",  # deep nesting in an ignored field
    ],
    ids=lambda h: repr(h)[:40],
)
async def test_a_header_that_is_not_a_message_is_a_protocol_error(header):
    with pytest.raises(ProtocolError, match="bad header"):
        await read_one(raw_frame(header))


async def test_fields_a_reader_does_not_know_are_ignored():
    assert await read_one(raw_frame({"type": "done", "id": 3, "future": [1, {"a": 2}]})) == (Done(id=3), b"")


class OlderAdmit(msgspec.Struct, tag="admit", frozen=True):
    """Admit as it was before it named the coordinator's model."""

    mac: bytes


async def test_an_admit_that_names_no_model_decodes_and_one_that_does_decodes_for_an_older_joiner():
    from_older = msgspec.msgpack.encode(OlderAdmit(mac=b"a" * 32))
    assert await read_one(raw_frame(from_older)) == (Admit(mac=b"a" * 32, model="", precision=""), b"")
    header = encode_frame(Admit(mac=b"a" * 32, model="smollm2", precision="f32"))[1]
    assert msgspec.msgpack.decode(header, type=OlderAdmit) == OlderAdmit(mac=b"a" * 32)


async def test_a_model_or_precision_in_an_admit_longer_than_an_offer_takes_is_a_protocol_error():
    for fields in ({"model": "m" * 4097}, {"precision": "p" * 65}):
        with pytest.raises(ProtocolError, match="bad header"):
            await read_one(frame(Admit(mac=b"a" * 32, **fields)))


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_protocol_error(data):
    decode_only_protocol_errors(data)


@FUZZ
@given(st.binary(min_size=1, max_size=200), st.binary(max_size=64))
def test_arbitrary_headers_behind_a_correct_prefix_decode_or_raise_protocol_error(header, payload):
    decode_only_protocol_errors(raw_frame(header, payload))


TAGS = [
    "challenge", "hello", "welcome", "forward", "result", "forward_batch", "batch_result", "reset", "done",
    "get_stats", "stats", "error",
]  # fmt: skip
FIELDS = [
    "id",
    "session",
    "start_pos",
    "tensor",
    "last_only",
    "compute_ms",
    "nonce",
    "mac",
    "version",
    "report",
    "resident_bytes",
    "sessions",
    "forwards",
    "message",
    "dtype",
    "shape",
    "entries",
    "rows",
]
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40)
    | st.sampled_from(["float32", "float16", "int32", "object"])
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), inner, max_size=5)
    ),
    max_leaves=20,
)


@FUZZ
@given(
    st.sampled_from(TAGS) | st.text(max_size=10),
    st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6),
    st.binary(max_size=64),
)
def test_plausible_headers_with_random_fields_decode_or_raise_protocol_error(tag, fields, payload):
    got = decode_only_protocol_errors(raw_frame({"type": tag, **fields}, payload))
    if got is not None:
        msg, body = got
        assert type(msg) in typing.get_args(Message)
        if isinstance(msg, (Forward, Result, ForwardBatch, BatchResult)):
            unpack_tensor(msg.tensor, body)  # a checked payload always unpacks


@st.composite
def mutated_frames(draw):
    data = bytearray(draw(st.sampled_from(ENCODED)))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "set"]))
        if op == "insert" or not data:
            data.insert(draw(st.integers(0, len(data))), draw(st.integers(0, 255)))
            continue
        at = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[at] = draw(st.integers(0, 255))
        else:
            del data[at]
    return bytes(data)


@FUZZ
@given(mutated_frames())
def test_mutated_valid_frames_decode_or_raise_protocol_error(data):
    got = decode_only_protocol_errors(data)
    if got is not None and isinstance(got[0], (Forward, Result)):
        unpack_tensor(got[0].tensor, got[1])


@FUZZ
@given(st.lists(mutated_frames() | st.sampled_from(ENCODED), min_size=1, max_size=3))
def test_a_stream_of_mutated_frames_yields_messages_until_a_protocol_error_or_eof(parts):
    async def consume() -> None:
        reader = await reader_of(b"".join(parts))
        while await asyncio.wait_for(read_frame(reader), 2) is not None:
            pass

    with contextlib.suppress(ProtocolError):
        asyncio.run(consume())


def batch(entries: list, shape: list[int]) -> bytes:
    """A ForwardBatch frame of float32 rows of `shape`, its entries given as msgpack-ready dicts."""
    n_bytes = 4 * int(np.prod(shape)) if shape else 4
    header = {
        "type": "forward_batch",
        "id": 1,
        "entries": entries,
        "tensor": {"dtype": "float32", "shape": shape},
    }
    return raw_frame(header, bytes(n_bytes))


def entry(session: str, rows: int, start_pos: int = 0) -> dict:
    return {"session": session, "start_pos": start_pos, "rows": rows, "last_only": True}


@pytest.mark.parametrize(
    ("entries", "shape", "why"),
    [
        ([entry("a", 2), entry("b", 2)], [3, 4], r"add up to 4, the tensor's shape is \[3, 4\]"),
        ([entry("a", 2), entry("b", 2)], [5, 4], r"add up to 4, the tensor's shape is \[5, 4\]"),
        ([entry("a", 1)], [], r"add up to 1, the tensor's shape is \[\]"),
        ([entry("a", 1), entry("a", 1)], [2, 4], "session 'a' appears more than once"),
        ([], [0, 4], "bad header"),
        ([entry("a", 0)], [0, 4], "bad header"),
        ([entry("a", 1, start_pos=-1)], [1, 4], "bad header"),
        ([entry("a b", 1)], [1, 4], "bad header"),
        ([entry(f"s{i}", 1) for i in range(MAX_BATCH + 1)], [MAX_BATCH + 1, 4], "bad header"),
    ],
    ids=["too-few-rows", "too-many-rows", "scalar", "session-twice", "no-entries", "zero-rows",
         "negative-position", "bad-session", "over-max-batch"],
)  # fmt: skip
async def test_a_malformed_forward_batch_is_a_protocol_error_naming_the_fault(entries, shape, why):
    with pytest.raises(ProtocolError, match=why):
        await read_one(batch(entries, shape))


async def test_a_batch_result_whose_rows_do_not_tile_its_tensor_is_a_protocol_error():
    tensor, payload = pack_tensor(np.zeros((3, 4), np.float32))
    with pytest.raises(ProtocolError, match=r"rows \[1, 1\] add up to 2"):
        await read_one(frame(BatchResult(id=1, compute_ms=0.0, rows=[1, 1], tensor=tensor), payload))


def test_a_blocking_socket_carries_every_message_kind_in_order():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sender, receiver = FrameSocket(ours), FrameSocket(theirs)
        for msg, payload in ALL_FRAMES:
            sender.send(msg, payload)
        ours.shutdown(socket.SHUT_WR)
        got = []
        while (received := receiver.recv()) is not None:
            got.append((received[0], bytes(received[1])))
    assert got == ALL_FRAMES


def test_a_payload_larger_than_the_socket_buffer_crosses_a_blocking_socket_whole():
    big = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)  # 4 MiB: several short writes and reads
    tensor, payload = pack_tensor(big)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        sender, receiver = FrameSocket(ours), FrameSocket(theirs)
        sender.settimeout(10)
        sending = threading.Thread(
            target=sender.send, args=(Result(id=1, compute_ms=0.0, tensor=tensor), payload)
        )
        sending.start()
        msg, got = receiver.recv()
        sending.join(10)
    np.testing.assert_array_equal(unpack_tensor(msg.tensor, got), big)


def test_a_tcp_frame_socket_sends_from_a_buffer_as_big_as_autotuning_would_grow_where_allowed():
    # A big frame then goes into the kernel at once, not as its thread is woken for more room; where a
    # socket may not be given that much, autotuning keeps the buffer (a set one never grows).
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname()) as ours,
    ):
        before = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        FrameSocket(ours)
        after = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    try:
        most = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
        allowed = int(Path("/proc/sys/net/core/wmem_max").read_text())
    except OSError:
        assert after == before  # no Linux sysctls to size it by: left as it was
        return
    if allowed >= most:
        assert after >= most, (before, after, most)
    else:
        assert after == before, (before, after, most, allowed)


def cut_stream(data: bytes) -> FrameSocket:
    """A FrameSocket reading `data`, then the end of the stream."""
    ours, theirs = socket.socketpair()
    with ours:
        ours.sendall(data)
    return FrameSocket(theirs)


@pytest.mark.parametrize("cut", [1, PREFIX.size, PREFIX.size + 3, -1])
def test_a_frame_cut_short_on_a_blocking_socket_is_a_protocol_error(cut):
    frames = cut_stream(ENCODED[-2][:cut])  # the ForwardBatch, which has header and payload
    with frames.sock, pytest.raises(ProtocolError, match=r"truncated|closed in the middle"):
        frames.recv()


def test_a_blocking_socket_refuses_an_oversized_prefix_without_waiting_for_its_bytes():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        frames = FrameSocket(theirs)
        frames.settimeout(5)  # bounds the test: a reader waiting for 4 GiB would time out instead
        ours.sendall(PREFIX.pack(10, 2**32 - 1))
        with pytest.raises(ProtocolError, match="exceeds"):
            frames.recv()


def test_a_read_that_outlasts_its_timeout_raises_timeout_error():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        frames = FrameSocket(theirs)
        frames.settimeout(0.05)
        ours.sendall(PREFIX.pack(10, 0))  # a prefix, then nothing
        with pytest.raises(TimeoutError):
            frames.recv()
