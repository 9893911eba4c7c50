"""The floor a hop is measured against: a loopback TCP round trip of the same bytes, to another process.

`python -m bench.rawsocket NBYTES` listens on a loopback port, prints it, and
echoes NBYTES-byte messages on one connection until it closes: a bare socket
and one thread, no framing, no messages, no compute.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

START_TIMEOUT_S = 30.0


def _recv_exactly(sock: socket.socket, buf: memoryview) -> bool:
    """Fill `buf` from `sock`; False when the peer closed first."""
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            return False
        got += n
    return True


def echo(nbytes: int) -> None:
    """Serve one connection: send back every `nbytes` bytes received, until it closes."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = memoryview(bytearray(nbytes))
        while _recv_exactly(conn, buf):
            conn.sendall(buf)


def round_trips(nbytes: int, count: int) -> list[float]:
    """Milliseconds of `count` round trips of `nbytes` bytes to an echo process over loopback TCP."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.rawsocket", str(nbytes)], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=START_TIMEOUT_S) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            payload, reply = bytes(nbytes), memoryview(bytearray(nbytes))
            times = []
            for _ in range(count + 1):  # the first warms the path and is dropped
                started = time.perf_counter()
                sock.sendall(payload)
                if not _recv_exactly(sock, reply):
                    raise ConnectionError("the echo process closed the connection")
                times.append((time.perf_counter() - started) * 1000)
        return times[1:]
    finally:
        proc.stdout.close()
        try:
            proc.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    echo(int(sys.argv[1]))
