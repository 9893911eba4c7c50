"""`rlx-worker` / `python -m workers`: build a stage, listen, print the NodeReport.

With --layers the worker builds those layers; with --join it dials a
coordinator and holds the layers it assigns, of the model the coordinator
says it runs unless --model names one, joining again whenever the
coordinator goes (see workers.join). Reports are the only lines written to
stdout (one per stage built); logs go to stderr. The shared token comes from
the environment (RLX_WORKER_TOKEN), never the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import sys
import time

from workers.join import BuildFailed, Joiner, JoinOptions, Refused
from workers.models import ModelSpecError, build, default_precision
from workers.protocol import auth
from workers.protocol.address import host_port, parse_host_port
from workers.protocol.report import LayerRange, encode_report
from workers.protocol.wire import DEFAULT_MAX_PAYLOAD
from workers.server import WorkerServer
from workers.threads import on_own_thread

PARENT_POLL_S = 0.5
EXIT_REFUSED = 2
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

log = logging.getLogger("workers")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlx-worker", description="Serve one pipeline stage over TCP.")
    p.add_argument("--model", help="synthetic[:layers=N,hidden=H,seed=S], fake:..., smollm2, gemma3, "
                   "or PATH.gguf (with --join, default: the one the coordinator runs, "
                   "found on this host)")  # fmt: skip
    p.add_argument("--layers", type=_layer_range, help="layers to hold, a..b (half-open)")
    p.add_argument("--join", type=_host_port, metavar="HOST:PORT",
                   help="dial the coordinator there and hold the layers it assigns")  # fmt: skip
    p.add_argument("--advertise", type=_advertised, metavar="HOST:PORT",
                   help="with --join: where the coordinator reaches this worker (default: this end of the "
                   "connection to the coordinator, with the port bound)")  # fmt: skip
    p.add_argument("--host", help="address to listen on (default 127.0.0.1; with --join, this end of "
                   "the connection to the coordinator)")  # fmt: skip
    p.add_argument("--port", type=int, default=0, help="port to listen on (0 = any free port)")
    p.add_argument("--precision", help="packed or f32 (default: packed for a GGUF file, else f32; with "
                   "--join, the coordinator's)")  # fmt: skip
    p.add_argument(
        "--max-payload", type=int, default=DEFAULT_MAX_PAYLOAD, help="largest tensor accepted, in bytes"
    )
    p.add_argument("--parent-pid", type=int, help="exit when this process is no longer our parent")
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        p.error(f"--port {args.port} is not in 0..65535")
    if args.join is None:
        missing = [flag for flag in ("--model", "--layers") if getattr(args, flag[2:]) is None]
        if missing:
            p.error(f"{' and '.join(missing)} required (or --join HOST:PORT to be given layers)")
        if args.advertise is not None:
            p.error("--advertise goes with --join")
        args.host = args.host or "127.0.0.1"
    else:
        if args.layers is not None:
            p.error("--layers and --join exclude each other: a worker that joins is given its layers")
    if args.precision is None and args.join is None:
        try:
            args.precision = default_precision(args.model)
        except ModelSpecError:
            args.precision = "f32"  # any: the build fails, naming what is wrong with the model
    return args


def _host_port(text: str) -> tuple[str, int]:
    try:
        return parse_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _advertised(text: str) -> str:
    _host_port(text)  # checked here, so that argparse names the option
    return text


def _layer_range(text: str) -> LayerRange:
    try:
        return LayerRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


async def serve(args: argparse.Namespace, token: str, started: float) -> None:
    """Build, listen, report, then serve until a signal or the parent is gone."""
    # On a thread that ends with the build, so that the kernels' only thread pool is the server's.
    stage = on_own_thread(lambda: build(args.model, args.layers, args.precision))
    build_ms = round((time.monotonic() - started) * 1000)
    worker = WorkerServer(stage, token, args.max_payload)
    server = await asyncio.start_server(worker.handle, args.host, args.port)
    host, port = server.sockets[0].getsockname()[:2]
    report = worker.describe(host_port(host, port), build_ms, args.model)
    sys.stdout.write(encode_report(report) + "\n")
    sys.stdout.flush()
    log.info("stage %s serving on %s:%s", args.layers, host, port)
    await _stopped(args).wait()
    log.info("stage %s stopping", args.layers)
    server.close()


async def join(args: argparse.Namespace, token: str) -> None:
    """Join the coordinator and serve what it assigns until a signal or the parent is gone."""
    host, port = args.join
    options = JoinOptions(
        coordinator=(host, port),
        model=args.model,
        precision=args.precision,
        token=token,
        host=args.host,
        port=args.port,
        advertise=args.advertise,
        max_payload=args.max_payload,
    )
    await Joiner(options).run(_stopped(args))
    log.info("stopping")


def _stopped(args: argparse.Namespace) -> asyncio.Event:
    """An event set by SIGTERM, SIGINT, or our parent's death when --parent-pid is given."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.parent_pid:
        # Held by the loop until it ends; the loop keeps only weak references to tasks.
        _watchers.add(loop.create_task(_watch_parent(args.parent_pid, stop)))
    return stop


_watchers: set[asyncio.Task] = set()


def _die_with_parent(pid: int) -> None:
    """Have Linux SIGKILL us when our parent dies; exit now if it already has."""
    # The poll in _watch_parent cannot run while we are stopped (SIGSTOP); the kernel's
    # signal still can. It fires when the thread that started us exits, which for the
    # launcher is its event loop's thread: the one that also stops us.
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            log.warning("no parent-death signal: prctl failed: %s", os.strerror(ctypes.get_errno()))
    # A parent that died before prctl took effect sends nothing: look once more.
    if os.getppid() != pid:
        sys.exit(f"rlx-worker: parent {pid} is gone (our parent is now {os.getppid()}); not starting")


async def _watch_parent(pid: int, stop: asyncio.Event) -> None:
    # Polling is the portable check; the parent-death signal set at start is the immediate one.
    while os.getppid() == pid:  # noqa: ASYNC110
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("parent %d is gone; exiting", pid)
    stop.set()


def main(argv: list[str] | None = None) -> None:
    started = time.monotonic()
    args = parse_args(argv)
    who = f"worker {args.layers}" if args.join is None else "worker (join)"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"{who} %(levelname)s %(message)s")
    if args.parent_pid:
        _die_with_parent(args.parent_pid)
    token = os.environ.get(auth.WORKER_TOKEN_ENV, "")
    if not token and args.host is not None and not auth.is_loopback(args.host):
        sys.exit(
            f"rlx-worker: refusing to listen on {args.host} without a token; set {auth.WORKER_TOKEN_ENV}"
        )
    try:
        asyncio.run(serve(args, token, started) if args.join is None else join(args, token))
    except Refused as exc:
        print(f"rlx-worker: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_REFUSED)
    except (ValueError, OSError, BuildFailed) as exc:
        sys.exit(f"rlx-worker: {exc}")
    except Exception as exc:  # any other build failure still gets a readable line
        log.exception("stage %s failed", args.layers)
        sys.exit(f"rlx-worker: cannot build stage {args.layers}: {type(exc).__name__}: {exc}")
    # A hung compute thread is a daemon; flush and leave without waiting on it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
