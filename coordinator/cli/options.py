"""The command line of `rlx-cluster`: its commands and options, each value checked as it is parsed.

coordinator.cli.main carries the command out.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
from contextlib import suppress

from coordinator.cli.hosts_plan import add_host_options
from coordinator.cli.remote import API_TOKEN_ENV, add_commands
from coordinator.launch.base import BUILD_TIMEOUT, LAUNCHERS, RAY_STRATEGIES
from coordinator.plan.calibration import PLANS
from coordinator.plan.place import JOIN_PLANS
from coordinator.runs.runner import MAX_ACTIVE
from coordinator.stages.pipeline import FORWARD_TIMEOUT, RECOVER_TIMEOUT
from workers.models import describe
from workers.models.layout import PRECISIONS
from workers.protocol import auth
from workers.protocol.address import parse_host_port
from workers.protocol.info import MAX_SESSIONS

DESCRIPTION = """`rlx-cluster`: launch a local pipeline, run it, print the table, serve the API.

rlx-cluster run   --model M --stages S [--seq N | --prompt P] [--serve]
rlx-cluster serve --model M --stages S [--join HOST:PORT | --launcher ray [--ray-address ADDR]]
rlx-cluster plan  --model M --stages S [--plan even|measured] [--precision P] [--db F] [--recalibrate]
rlx-cluster plan  --hosts hosts.toml [--model M] [--objective latency|throughput] [--simulate N]
rlx-cluster runs  [--url URL] [--limit N]
rlx-cluster show  ID|latest [--table | --json] [--url URL]
"""

DEFAULT_HTTP = "127.0.0.1:8470"
# The longest timeout an option takes, in seconds (a day); a longer one is surely a slip.
MAX_TIMEOUT_S = 86_400.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(
        prog="rlx-cluster", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--exit-with-parent", type=_pid, default=None, metavar="PID",
        help="stop as on SIGTERM once process PID, which started this one, is gone (the pytest fixture's)",
    )  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--model",
        default=None,
        help="synthetic[:layers=N,hidden=H,seed=S], smollm2, gemma3, PATH.gguf, or fake:... (required but "
        "by plan --hosts, whose file may give the model's shape)",
    )
    common.add_argument("--stages", type=_stages, default=None, help="number of worker processes")
    common.add_argument(
        "--plan",
        choices=PLANS,
        default=None,
        help="how to split the layers: even, or measured (each layer timed at decode, then the slowest "
        "stage made as fast as it can be; the default for GGUF models launched here)",
    )
    common.add_argument("-v", "--verbose", action="store_true", help="log workers' output and every step")
    serving = _serving_options()
    run = sub.add_parser("run", parents=[common, serving], help="launch, do one run, print the table")
    run.add_argument("--seq", type=int, default=None, help="positions in the synthetic input (default 16)")
    run.add_argument("--seed", type=int, default=0, help="seed for the synthetic input or for sampling")
    run.add_argument("--prompt", default=None, help="text to continue (language models)")
    run.add_argument("--max-new-tokens", type=int, default=32)
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--serve", action="store_true", help="keep the pipeline and the API up until Ctrl-C")
    serve = sub.add_parser("serve", parents=[common, serving], help="launch and serve the API until Ctrl-C")
    plan = sub.add_parser("plan", parents=[common], help="print how the layers would be split")
    plan.add_argument(
        "--precision", default=None, choices=PRECISIONS, help="the precision to measure in (as run and serve)"
    )
    plan.add_argument("--db", type=_db_path, default=None, help="the run store whose kept layer costs to use")
    plan.add_argument("--recalibrate", action="store_true", help="measure the layers though costs are kept")
    add_host_options(plan)
    add_commands(sub)
    args = p.parse_args(argv)
    if getattr(args, "model", "") is None and not getattr(args, "hosts", None):
        p.error("the following arguments are required: --model")
    if args.command in ("run", "serve"):
        args.max_active = _max_active(run if args.command == "run" else serve, args)
    return args


def _serving_options() -> argparse.ArgumentParser:
    """The options of the commands that start a cluster."""
    serving = argparse.ArgumentParser(add_help=False)
    _add_run_options(serving)
    _add_api_options(serving)
    _add_worker_options(serving)
    return serving


def _add_run_options(serving: argparse.ArgumentParser) -> None:
    """How the workers compute, how long they may take, how many runs at once, where runs are kept."""
    serving.add_argument(
        "--precision",
        default=None,
        choices=PRECISIONS,
        help="packed (the file's own blocks, computed in place) or f32; default: packed for a GGUF file, "
        "else f32",
    )
    serving.add_argument(
        "--db",
        type=_db_path,
        default=None,
        help="run history file (default under $XDG_STATE_HOME/rlx-cluster); :memory: keeps none",
    )
    serving.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        help="mark the runs a coordinator that died left queued or running on --db interrupted, instead "
        "of resuming those that ran the same model and plan (the default)",
    )
    serving.add_argument(
        "--forward-timeout",
        type=_seconds,
        default=FORWARD_TIMEOUT,
        help="seconds a stage may take per forward",
    )
    serving.add_argument(
        "--recover-timeout",
        type=_seconds_or_zero,
        default=RECOVER_TIMEOUT,
        help="seconds a run whose stage went down waits for it to be back, then refills it and goes on "
        "(0: the run fails at once)",
    )
    serving.add_argument(
        "--build-timeout",
        type=_seconds,
        default=BUILD_TIMEOUT,
        help="seconds a worker may take to build and report",
    )
    serving.add_argument(
        "--chat-template",
        type=_template_file,
        default=None,
        metavar="FILE",
        help="a Jinja chat template to chat through instead of the model file's own (a file without one "
        "takes no chat until given one)",
    )
    serving.add_argument(
        "--max-active",
        default=None,
        metavar="N",
        help=f"runs executing at once, their decode steps batched into one forward (default {MAX_ACTIVE}); "
        "at most the sessions the model's workers keep",
    )


def _add_api_options(serving: argparse.ArgumentParser) -> None:
    """Where the HTTP API listens and the token it asks for."""
    serving.add_argument(
        "--http",
        type=_host_port,
        default=DEFAULT_HTTP,
        help=f"HOST:PORT for the API (default {DEFAULT_HTTP})",
    )
    serving.add_argument(
        "--token",
        default=os.environ.get(API_TOKEN_ENV, ""),
        help=f"API bearer token (or ${API_TOKEN_ENV}); required off loopback",
    )
    serving.add_argument(
        "--allow-host", type=_host_name, action="append", default=[], metavar="NAME",
        help="a name clients reach the API by, besides localhost and its address (repeatable); without a "
        "token, a request naming any other host is refused, as a page rebinding its name here would",
    )  # fmt: skip


def _add_worker_options(serving: argparse.ArgumentParser) -> None:
    """Where the workers come from: attached, joining, or launched here or by Ray."""
    serving.add_argument(
        "--attach",
        type=_attach,
        default=(),
        help=f"comma-separated addresses of workers to attach to instead of launching (token from "
        f"${auth.WORKER_TOKEN_ENV})",
    )
    serving.add_argument(
        "--join",
        type=_host_port,
        default=None,
        help=f"serve only: listen at HOST:PORT for workers that join (rlx-worker --join) instead of "
        f"launching; token from ${auth.WORKER_TOKEN_ENV}",
    )
    serving.add_argument(
        "--join-plan", choices=JOIN_PLANS, default="latency",
        help="with --join: what the first plan of workers that measured themselves minimizes (latency, "
        "the default: a decode step; throughput: the slowest stage), or even: split evenly (or by "
        "memory) in join order, whatever they measured",
    )  # fmt: skip
    serving.add_argument(
        "--launcher", choices=LAUNCHERS, default="local",
        help="how launched workers come to exist: local subprocesses (default) or actors placed by Ray",
    )  # fmt: skip
    serving.add_argument(
        "--ray-address", default=None, metavar="ADDR",
        help="with --launcher ray: the Ray cluster (auto, or HOST:PORT); default: start a local instance",
    )  # fmt: skip
    serving.add_argument(
        "--ray-strategy", choices=RAY_STRATEGIES, default=None,
        help="with --launcher ray: how the stages are spread over Ray's nodes (default SPREAD)",
    )  # fmt: skip
    serving.add_argument(
        "--ray-cpus", type=_cpus, default=None, help="with --launcher ray: CPUs held per stage (default 1)"
    )


def _stages(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (at most the layers), got {text!r}")
    return int(text)


def _max_active(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--max-active, at most the sessions the model's workers keep (more runs would evict each other's)."""
    text = args.max_active
    if text is None:
        return MAX_ACTIVE
    try:
        most = describe(args.model).max_sessions
    except (ValueError, OSError):  # the command itself then says what is wrong with the model
        most = MAX_SESSIONS
    # A bounded length: int() refuses thousands of digits with a ValueError of its own.
    if not (text.isascii() and text.isdigit() and len(text) < 20) or not 1 <= int(text) <= most:
        parser.error(f"argument --max-active: must be a whole number of runs in 1..{most}, got {text!r}")
    return int(text)


def _pid(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a process id (a whole number >= 1), got {text!r}")
    return int(text)


def _host_name(text: str) -> str:
    name = text.strip().strip("[]").lower()
    with suppress(ValueError):
        return str(ipaddress.ip_address(name))
    if not re.fullmatch(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?", name):
        raise argparse.ArgumentTypeError(f"expected a host name or address, no port or scheme, got {text!r}")
    return name


def _number(text: str, highest: float, what: str) -> float:
    """`text` as a number in (0, highest], or an argparse error saying it must be `what`."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= highest:  # nan fails every comparison
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def _cpus(text: str) -> float:
    return _number(text, math.nextafter(math.inf, 0), "a number of CPUs > 0")


def _seconds(text: str) -> float:
    return _number(text, MAX_TIMEOUT_S, f"seconds in (0, {MAX_TIMEOUT_S:g}]")


def _seconds_or_zero(text: str) -> float:
    if text.strip() in ("0", "0.0"):
        return 0.0
    return _number(text, MAX_TIMEOUT_S, f"0 or seconds in (0, {MAX_TIMEOUT_S:g}]")


def _db_path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a file (or :memory: to keep no history), got {text!r}")
    return text


def _template_file(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a Jinja template file, got {text!r}")
    return text


def _host_port(text: str) -> tuple[str, int]:
    try:
        return parse_host_port(text, listen=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _attach(text: str) -> tuple[str, ...]:
    addrs = tuple(a.strip() for a in text.split(","))
    for addr in addrs:
        if not addr.rpartition(":")[0]:
            raise argparse.ArgumentTypeError(f"expected HOST:PORT,...; in {text!r}, {addr!r} names no host")
        _host_port(addr)
    return addrs
