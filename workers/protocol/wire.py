"""Framing between the coordinator and a worker: how the messages (workers.protocol.messages) travel.

A frame is an 8-byte prefix (header length, payload length; both u32, big
endian), a msgpack header holding one `Message`, then the payload: the raw
bytes of at most one tensor. Lengths are checked against limits before
anything is read or allocated. Every way a frame can be wrong raises
`ProtocolError`; nothing here decides what to do about it.
"""

from __future__ import annotations

import asyncio
import functools
import math
import socket
import struct

import msgspec
import numpy as np

from workers.protocol.messages import DTYPES, BatchResult, ForwardBatch, Message, Tensor

PREFIX = struct.Struct("!II")
MAX_HEADER = 64 * 1024
DEFAULT_MAX_PAYLOAD = 256 * 1024 * 1024
# Bytes asked of the kernel per read: a decode step's frame whole, a prefill's in a few reads.
RECV_CHUNK = 256 * 1024
# Looked up per tensor on the hot path, where asking numpy for a dtype's name or size costs microseconds.
_ITEMSIZE = {name: np.dtype(kind).itemsize for name, kind in DTYPES.items()}
_NAMES = {np.dtype(kind): name for name, kind in DTYPES.items()}


class ProtocolError(Exception):
    """A frame or message that breaks the wire rules; the connection must close."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_frame(msg: Message, payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """Return the parts of one frame, ready for `writer.writelines`."""
    header = _encoder.encode(msg)
    if len(header) > MAX_HEADER:
        raise ProtocolError(f"header of {len(header)} bytes exceeds the {MAX_HEADER}-byte limit")
    return [PREFIX.pack(len(header), len(payload)), header, payload]


def check_prefix(prefix: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[int, int]:
    """Unpack a frame prefix; refuse lengths over the limits."""
    header_len, payload_len = PREFIX.unpack(prefix)
    if not 0 < header_len <= MAX_HEADER:
        raise ProtocolError(f"header length {header_len} outside 1..{MAX_HEADER}")
    if payload_len > max_payload:
        raise ProtocolError(f"payload length {payload_len} exceeds the {max_payload}-byte limit")
    return header_len, payload_len


def decode_header(header: bytes) -> Message:
    """Decode a msgpack header into a Message."""
    try:
        return _decoder.decode(header)
    except (msgspec.DecodeError, RecursionError) as exc:  # deep nesting, even in skipped fields
        raise ProtocolError(f"bad header: {exc}") from exc


def check_payload(msg: Message, payload: bytes | memoryview) -> None:
    """Check that the payload is exactly what the header describes."""
    tensor = getattr(msg, "tensor", None)
    if tensor is None:
        if payload:
            raise ProtocolError(f"{type(msg).__name__} carries no payload, got {len(payload)} bytes")
        return
    itemsize = _ITEMSIZE.get(tensor.dtype)
    if itemsize is None:
        raise ProtocolError(f"dtype {tensor.dtype!r} not allowed; allowed: {', '.join(DTYPES)}")
    expected = math.prod(tensor.shape) * itemsize
    if expected != len(payload):
        raise ProtocolError(
            f"shape {tensor.shape} of {tensor.dtype} needs {expected} bytes, payload has {len(payload)}"
        )
    match msg:
        case ForwardBatch(entries=entries):
            _check_rows(msg, [e.rows for e in entries])
            sessions = [e.session for e in entries]
            if len(set(sessions)) != len(sessions):
                twice = next(s for s in sessions if sessions.count(s) > 1)
                raise ProtocolError(f"session {twice!r} appears more than once in a forward_batch")
        case BatchResult(rows=rows):
            _check_rows(msg, rows)


def _check_rows(msg: ForwardBatch | BatchResult, rows: list[int]) -> None:
    """The entries' rows must tile the stacked tensor's first dimension exactly."""
    shape = msg.tensor.shape
    if not shape or sum(rows) != shape[0]:
        raise ProtocolError(
            f"{type(msg).__name__} rows {rows} add up to {sum(rows)}, the tensor's shape is {shape}"
        )


async def read_frame(
    reader: asyncio.StreamReader, max_payload: int = DEFAULT_MAX_PAYLOAD
) -> tuple[Message, bytes] | None:
    """Read one frame; None on a clean end of stream between frames."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError(f"truncated frame prefix ({len(exc.partial)} bytes)") from exc
    header_len, payload_len = check_prefix(prefix, max_payload)
    try:
        header = await reader.readexactly(header_len)
        msg = decode_header(header)
        payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError("connection closed in the middle of a frame") from exc
    check_payload(msg, payload)
    return msg, payload


async def send(writer: asyncio.StreamWriter, msg: Message, payload: bytes | memoryview = b"") -> None:
    """Write one frame and wait for the transport to drain."""
    writer.writelines(encode_frame(msg, payload))
    await writer.drain()


class FrameSocket:
    """A blocking socket that carries whole frames in as few system calls as it can.

    A frame goes out in one gathered write and usually comes in with one read.
    Timeouts are the kernel's (SO_RCVTIMEO, SO_SNDTIMEO), so no poll() comes
    before each call; a read or write that runs out of time raises TimeoutError.
    """

    def __init__(self, sock: socket.socket, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        sock.setblocking(True)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if (most := _send_buffer_most()) is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, most)
        self.sock, self.max_payload = sock, max_payload
        self._rest = memoryview(b"")
        self._scratch = memoryview(bytearray(RECV_CHUNK))
        self._timeout: float | None = None

    def settimeout(self, seconds: float | None) -> None:
        """Bound each read and write to `seconds` (None: no bound)."""
        if seconds == self._timeout:
            return
        # A zero timeval means no bound, so a bound rounds up to a microsecond at least.
        whole, micros = (0, 0) if seconds is None else divmod(max(1, round(seconds * 1e6)), 1_000_000)
        value = struct.pack("@ll", whole, micros)
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            self.sock.setsockopt(socket.SOL_SOCKET, option, value)
        self._timeout = seconds

    def send(self, msg: Message, payload: bytes | memoryview = b"") -> None:
        """Write one frame: one gathered write, resumed where a short one stopped."""
        prefix, header, body = encode_frame(msg, payload)
        head = prefix + header
        try:
            sent = self.sock.sendmsg([head, body]) if len(body) else self.sock.send(head)
            if sent < len(head):
                self.sock.sendall(head[sent:])
                sent = len(head)
            if sent - len(head) < len(body):
                self.sock.sendall(memoryview(body)[sent - len(head) :])
        except BlockingIOError as exc:  # SO_SNDTIMEO ran out
            raise TimeoutError("timed out writing a frame") from exc

    def recv(self) -> tuple[Message, bytes | memoryview] | None:
        """Read one frame; None on a clean end of stream between frames."""
        try:
            prefix = self._read(PREFIX.size)
            if not prefix:
                return None
            if len(prefix) < PREFIX.size:
                raise ProtocolError(f"truncated frame prefix ({len(prefix)} bytes)")
            header_len, payload_len = check_prefix(prefix, self.max_payload)
            frame = self._read(header_len + payload_len)
        except BlockingIOError as exc:  # SO_RCVTIMEO ran out
            raise TimeoutError("timed out reading a frame") from exc
        if len(frame) < header_len + payload_len:
            raise ProtocolError("connection closed in the middle of a frame")
        msg = decode_header(frame[:header_len])
        payload = frame[header_len:] if payload_len else b""
        check_payload(msg, payload)
        return msg, payload

    def _read(self, n: int) -> memoryview:
        """Exactly `n` bytes, fewer only at the end of the stream, copied once from the kernel's."""
        rest = self._rest
        if len(rest) >= n:
            self._rest = rest[n:]
            return rest[:n]
        if n - len(rest) > RECV_CHUNK:  # a big payload: read straight into a buffer of its size
            out = bytearray(n)
            view, have = memoryview(out), len(rest)
            view[:have] = rest
            while have < n and (got := self.sock.recv_into(view[have:])):
                have += got
            self._rest = memoryview(b"")
            return view[:have]
        # Into a buffer kept for it: sock.recv would allocate (and map) RECV_CHUNK bytes for each read.
        parts, have = ([bytes(rest)] if rest else []), len(rest)
        while have < n and (got := self.sock.recv_into(self._scratch)):
            parts.append(bytes(self._scratch[:got]))
            have += got
        data = memoryview(parts[0] if len(parts) == 1 else b"".join(parts))
        self._rest = data[n:]
        return data[:n]


@functools.cache  # per process: every connection would read the same two files
def _send_buffer_most() -> int | None:
    """The send buffer TCP's autotuning grows to at most (Linux's tcp_wmem), where a socket may be given
    that much at once (net.core.wmem_max); None where it may not, or the system does not say.

    A frame bigger than the send buffer goes out only as fast as its sending thread is woken to write
    more as acknowledgements free room, and a woken thread may wait for a core: a last stage's 196 KB
    of logits, between namespaces on 2 busy cores, cost 1.6-4.3 ms beyond its compute in 16 of 34
    rehearsal runs (0.3-0.4 ms in the others), in none of 24 with the buffer set (either end). Set
    only where it is no smaller than autotuning's own limit, as a set size is never grown further: on
    a long link a smaller one would bound a prompt's transfer to it per round trip.
    """
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem", encoding="ascii") as f:
            most = int(f.read().split()[2])
        with open("/proc/sys/net/core/wmem_max", encoding="ascii") as f:
            allowed = int(f.read())
    except (OSError, ValueError, IndexError):
        return None
    return most if allowed >= most else None


def pack_tensor(array: np.ndarray) -> tuple[Tensor, memoryview]:
    """Describe an array for the wire and expose its bytes without copying."""
    name = _NAMES.get(array.dtype)
    if name is None:
        raise ProtocolError(f"dtype {array.dtype.name!r} not allowed; allowed: {', '.join(DTYPES)}")
    tensor = Tensor(dtype=name, shape=list(array.shape))
    if array.ndim and array.size and array.flags.c_contiguous:
        return tensor, memoryview(array).cast("B")
    array = np.asarray(array, order="C")  # ascontiguousarray would turn a 0-d array into 1-d
    # A flat byte view: memoryview.cast refuses shapes with a zero in them.
    return tensor, memoryview(array.reshape(-1).view(np.uint8))


def unpack_tensor(tensor: Tensor, payload: bytes | memoryview) -> np.ndarray:
    """View a checked payload as the array its header describes (read-only)."""
    array = np.frombuffer(payload, dtype=DTYPES[tensor.dtype]).reshape(tensor.shape)
    array.flags.writeable = False  # a payload read into a bytearray would allow writes
    return array
