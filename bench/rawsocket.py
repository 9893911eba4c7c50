"""The floor a hop is measured against: a loopback TCP round trip of the same bytes, to another process.

`python -m bench.rawsocket NBYTES [HOLD_MS]` listens on a loopback port, prints
it, and echoes NBYTES-byte messages on one connection until it closes: a bare
socket and one thread, no framing, no messages, no compute. With HOLD_MS it
sleeps that long before each echo, as a stage that computes would, and writes
how long it really held into the reply's first 8 bytes, which the round trip
leaves out: both ends then wake from an idle wait, as in a pipeline.

`python -m bench.rawsocket framed` echoes the wire's frames instead: each
Forward is answered with a Result of the same tensor, through FrameSocket and
msgspec at both ends, as a stage's hop is, but with no stage, no compute lock
and no forward chain. Between the two floors lies what framing costs in
Python; above the framed one, what a worker's and the coordinator's handling
of a forward adds.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from workers.protocol.messages import Forward, Result
from workers.protocol.wire import FrameSocket, pack_tensor, unpack_tensor

START_TIMEOUT_S = 30.0
HELD = struct.Struct("<d")  # a held echo's milliseconds of sleep, at the start of its reply


def _recv_exactly(sock: socket.socket, buf: memoryview) -> bool:
    """Fill `buf` from `sock`; False when the peer closed first."""
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            return False
        got += n
    return True


def echo(nbytes: int, hold_ms: float = 0.0) -> None:
    """Serve one connection: send back every `nbytes` bytes received (after `hold_ms`), until it closes."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(nbytes))
        while _recv_exactly(conn, buf):
            if hold_ms:
                started = time.perf_counter()
                time.sleep(hold_ms / 1000)
                HELD.pack_into(buf, 0, (time.perf_counter() - started) * 1000)
            conn.sendall(buf)


def framed_echo() -> None:
    """Serve one connection with the wire's frames: each Forward answered with a Result of its tensor."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
    with conn:
        frames = FrameSocket(conn)
        while (frame := frames.recv()) is not None:
            msg, payload = frame
            tensor, out = pack_tensor(unpack_tensor(msg.tensor, payload))
            frames.send(Result(id=msg.id, compute_ms=0.0, tensor=tensor), out)


@contextmanager
def _connected(*args: str) -> Iterator[socket.socket]:
    """A loopback connection to a new `python -m bench.rawsocket args…`, which ends when it closes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.rawsocket", *args], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=START_TIMEOUT_S) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            yield sock
    finally:
        proc.stdout.close()
        try:
            proc.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def round_trips(nbytes: int, count: int, hold_ms: float = 0.0) -> list[float]:
    """Milliseconds of `count` round trips of `nbytes` bytes to an echo process over loopback TCP.

    With `hold_ms` the echo sleeps that long before each reply; the time it held is left out.
    """
    if hold_ms and nbytes < HELD.size:
        raise ValueError(f"a held echo writes its hold into the first {HELD.size} bytes, got {nbytes}")
    with _connected(str(nbytes), str(hold_ms)) as sock:
        payload, reply = bytes(nbytes), memoryview(bytearray(nbytes))
        times = []
        for _ in range(count + 1):  # the first warms the path and is dropped
            started = time.perf_counter()
            sock.sendall(payload)
            if not _recv_exactly(sock, reply):
                raise ConnectionError("the echo process closed the connection")
            held = HELD.unpack_from(reply)[0] if hold_ms else 0.0
            times.append((time.perf_counter() - started) * 1000 - held)
    return times[1:]


def framed_round_trips(nbytes: int, count: int) -> list[float]:
    """Milliseconds of `count` Forward → Result round trips of a float32 tensor of `nbytes` bytes."""
    x = np.ones((1, nbytes // 4), dtype=np.float32)
    with _connected("framed") as sock:
        frames = FrameSocket(sock)
        times = []
        for i in range(count + 1):  # the first warms the path and is dropped
            started = time.perf_counter()
            tensor, payload = pack_tensor(x)
            frames.send(Forward(id=i, session="hop", start_pos=0, tensor=tensor), payload)
            if frames.recv() is None:
                raise ConnectionError("the echo process closed the connection")
            times.append((time.perf_counter() - started) * 1000)
    return times[1:]


if __name__ == "__main__":
    if sys.argv[1:] == ["framed"]:
        framed_echo()
    else:
        echo(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
