"""`rlx-cluster`: launch a local pipeline, run it, print the table, serve the API.

Its options, each value checked as it is parsed, are in coordinator.cli.options; this carries them out.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, AsyncExitStack, nullcontext, suppress
from dataclasses import replace
from typing import TYPE_CHECKING

import msgspec

from coordinator.cli.hosts_plan import plan_over_hosts
from coordinator.cli.options import parse_args
from coordinator.cli.parent import die_with_parent, watch_parent
from coordinator.cli.remote import API_TOKEN_ENV, RemoteError
from coordinator.cli.remote import command as remote_command
from coordinator.cluster import Cluster, ClusterConfig, model_tokenizer, open_cluster, plan_stages
from coordinator.launch.base import LaunchError, local_env
from coordinator.plan.calibration import default_plan, make_plan, plan_lines
from coordinator.runs.requests import RunRequest, encode_prompt
from coordinator.stages.client import WorkerError
from coordinator.stages.pipeline import StageFailed
from coordinator.store.history import StoreError, default_path
from workers.models import default_precision, describe
from workers.protocol import auth
from workers.protocol.address import host_port
from workers.protocol.report import LayerRange

if TYPE_CHECKING:
    from coordinator.api.server import Reserved

log = logging.getLogger("coordinator")


class UsageError(Exception):
    """A command line that cannot be carried out."""


QUESTION = "What is the capital of France?"
# A model with a chat template is asked the question as a user turn; a base model (Gemma 3 270M, a
# file without a template) answers nothing useful to an instruction, so it is given a text to complete,
# which ends with the answer's line: a base model goes on to ask itself the next question.
CHAT_PROMPT = f"{QUESTION} Answer in one sentence."
COMPLETION_PROMPT = f"Question: {QUESTION}\nAnswer:"


def default_question(chats: bool) -> dict[str, str | bool | list[str]]:
    """The run fields a face sends when given no prompt; `chats`: the model has a chat template."""
    if chats:
        return {"prompt": CHAT_PROMPT, "chat": True}
    return {"prompt": COMPLETION_PROMPT, "stop": ["\n"]}


def run_request(args: argparse.Namespace, takes_tokens: bool, chats: bool = True) -> RunRequest:
    """The run the command line asks for (validated like an HTTP body); `chats`: the model has a template."""
    # Without --prompt a language model answers the default question: a chat turn, or a text to complete.
    asked = default_question(chats) if takes_tokens and args.prompt is None else {"prompt": args.prompt}
    fields = dict(seq=args.seq, seed=args.seed, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_k=args.top_k) | asked  # fmt: skip
    fields["chat"] = args.chat or bool(asked.get("chat"))
    try:
        return msgspec.convert(fields, RunRequest)
    except msgspec.ValidationError as exc:
        raise UsageError(f"bad run options: {exc}") from exc


def _http_addr(addr: tuple[str, int], token: str) -> tuple[str, int]:
    if not auth.is_loopback(addr[0]) and not token:
        raise UsageError(
            f"--http {addr[0]}:{addr[1]}: serving off loopback needs a token (--token or ${API_TOKEN_ENV})"
        )
    return addr


def _join_addr(args: argparse.Namespace, worker_token: str) -> str:
    """The address to listen on for joining workers, or "" when they are launched or attached."""
    if args.join is None:
        return ""
    host, port = args.join
    if args.command != "serve":
        raise UsageError("--join goes with serve: workers join over time; POST /runs once they have")
    if args.attach:
        raise UsageError("--join and --attach exclude each other: workers either join or are attached")
    if not worker_token and not auth.is_loopback(host):
        raise UsageError(f"--join {host}:{port}: listening off loopback needs ${auth.WORKER_TOKEN_ENV}")
    return host_port(host, port)


def _ray_options(args: argparse.Namespace) -> dict:
    """The Ray options of the command line, refused when the workers are not placed by Ray."""
    given = {"ray_address": args.ray_address, "ray_strategy": args.ray_strategy, "ray_cpus": args.ray_cpus}
    given = {name: value for name, value in given.items() if value is not None}
    if given and args.launcher != "ray":
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"{flags}: only with --launcher ray")
    if args.launcher == "ray" and (args.attach or args.join):
        raise UsageError("--launcher ray starts the workers: not with --attach or --join")
    return given


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _plan(args: argparse.Namespace) -> str:
    """The --plan asked for, else the model's default where workers are launched here, else even."""
    if args.plan and args.attach:
        raise UsageError(f"--plan {args.plan} and --attach exclude each other: attached workers hold layers")
    if args.plan:
        return args.plan
    return "even" if args.attach or args.join else default_plan(args.model)


def cluster_config(args: argparse.Namespace, progress: Callable[[str], None] = say) -> ClusterConfig:
    """The cluster the command line asks for."""
    worker_token = os.environ.get(auth.WORKER_TOKEN_ENV, "")
    return ClusterConfig(
        model=args.model,
        stages=args.stages or 1,
        precision=args.precision or default_precision(args.model),
        plan=_plan(args),
        db=args.db or default_path(),
        attach=args.attach,
        join=_join_addr(args, worker_token),
        join_objective=args.join_plan,
        worker_token=worker_token,
        forward_timeout=args.forward_timeout,
        recover_timeout=args.recover_timeout,
        build_timeout=args.build_timeout,
        max_active=args.max_active,
        progress=progress,
        launcher=args.launcher,
        chat_template=args.chat_template or "",
        resume=args.resume,
        **_ray_options(args),
    )


async def amain(args: argparse.Namespace) -> int:
    """Carry out the command; the exit status is 2 for bad input, 1 when the workers fail."""
    try:
        return await _command(args)
    except (LaunchError, WorkerError, StageFailed) as exc:
        say(f"rlx-cluster: {exc}")
        return 1
    except (UsageError, StoreError, ValueError, OSError) as exc:  # ModelSpecError, PlanError are ValueErrors
        say(f"rlx-cluster: {exc}")
        return 2
    except RemoteError as exc:
        say(f"rlx-cluster: {exc}")
        return exc.status


async def _command(args: argparse.Namespace) -> int:
    if args.command in ("runs", "show"):
        return await remote_command(args)
    if args.command == "plan" and args.hosts:
        return await plan_over_hosts(args)
    info = describe(args.model)
    if args.command == "plan":
        precision = args.precision or default_precision(args.model)
        env = local_env(args.stages or 1)
        plan = await make_plan(args.plan or default_plan(args.model), args.model, info.n_layers,
                               args.stages or 1, precision, env, progress=say,
                               db=args.db or default_path(), recalibrate=args.recalibrate)  # fmt: skip
        print("\n".join(plan_lines(plan, info.n_layers)), flush=True)
        return 0
    http = _http_addr(args.http, args.token) if args.command == "serve" or args.serve else None
    tokenizer = None
    if info.input == "tokens" and (args.command == "run" or args.chat_template):
        # Loaded first: a template file that cannot be read or parsed fails before anything starts.
        tokenizer = model_tokenizer(args.model, args.chat_template or "")
    chats = tokenizer is not None and tokenizer.chat_template is not None
    req = run_request(args, info.input == "tokens", chats) if args.command == "run" else None
    if req is not None and tokenizer is not None:
        # Encoded before any layer is timed or worker started: a prompt the model cannot take fails at once.
        encode_prompt(req, tokenizer, info)
    async with AsyncExitStack() as stack:
        # The API's address is bound before anything is measured or built, so a port in use fails at once.
        if http is not None:
            reserved = await _reserve(http)
            stack.callback(reserved.close)
        config = cluster_config(args)
        if not (args.attach or args.join):  # launched here: planned (maybe measured) before the display
            config = replace(config, ranges=tuple((await plan_stages(config, info)).ranges))
        with _build_progress(args, config.ranges) as progress:
            opening = open_cluster(replace(config, progress=progress), tokenizer)
            cluster = await stack.enter_async_context(opening)
        status = 0 if req is None else await run_once(cluster, req)
        if http is not None:
            await serve_http(cluster, http, args.token, reserved, (*args.allow_host, http[0]))
        return status


def _build_progress(
    args: argparse.Namespace, ranges: tuple[LayerRange, ...]
) -> AbstractContextManager[Callable[[str], None]]:
    """A line per stage redrawn in place while local workers build on a terminal; else plain lines."""
    if args.attach or args.join or args.verbose or not sys.stderr.isatty():
        return nullcontext(say)
    # Imported here: rich is only needed on a terminal.
    from coordinator.cli.progress import BuildDisplay

    return BuildDisplay(list(ranges))


async def run_once(cluster: Cluster, req: RunRequest) -> int:
    """Do one run, printing a language model's text as it comes, then the table; 1 if the run failed."""
    on_text = None
    if cluster.tokenizer is not None:
        say(f"prompt: {req.prompt}")
        on_text = functools.partial(print, end="", flush=True)
    run = await cluster.runner.run(req, on_text=on_text)
    if cluster.tokenizer is not None:
        print(flush=True)
    print(run.table(), end="", flush=True)
    if run.status != "ok":
        say(f"run {run.id} {run.status}: {run.error}")
        return 1
    return 0


async def _reserve(addr: tuple[str, int]) -> Reserved:
    """Bind the API's address, to be served once the cluster is up; a UsageError when it cannot be."""
    # The HTTP side (aiohttp, the API's modules: ~0.4 s of CPU) is imported by the commands that serve.
    from coordinator.api.server import Reserved

    try:
        return await Reserved.bind(*addr)
    except OSError as exc:
        raise UsageError(f"cannot serve on {addr[0]}:{addr[1]}: {exc.strerror or exc}") from exc


async def serve_http(
    cluster: Cluster, addr: tuple[str, int], token: str, reserved: Reserved, allow_hosts: tuple[str, ...] = ()
) -> None:
    """Serve the API on `addr`, bound already (`_reserve`), until cancelled (Ctrl-C or SIGTERM).

    With the connection limits of http_server; `allow_hosts` as create_app takes them. On the way out
    the runs stop first (those in progress stored `interrupted`), then the server ends its responses
    within its grace (server.SHUTDOWN_GRACE_S), then the cluster closes.
    """
    from coordinator.api import create_app
    from coordinator.api.server import serve

    app = create_app(cluster, token, allow_hosts=allow_hosts)
    app.on_shutdown.insert(0, functools.partial(_stop_runs, cluster))
    # Nothing inside the block raises OSError but listening on the address.
    try:
        async with serve(app, addr[0], addr[1], reserved=reserved) as served:
            _say_how_to_use(cluster, f"http://{addr[0]}:{served.port}", token)
            await asyncio.Event().wait()
    except OSError as exc:
        raise UsageError(f"cannot serve on {addr[0]}:{addr[1]}: {exc.strerror or exc}") from exc


async def _stop_runs(cluster: Cluster, _app: object) -> None:
    """Stop the runs before the server waits for its responses (the app's first shutdown step).

    A streamed chat then ends at once with its run `interrupted`, instead of
    generating to its token budget while the signal waits; event streams
    carry the runs' ends before they close.
    """
    await cluster.runner.close()


def _say_how_to_use(cluster: Cluster, base: str, token: str) -> None:
    """Tell the person at the terminal where the API is and how to try it."""
    header = f" -H 'Authorization: Bearer {'$' + API_TOKEN_ENV}'" if token else ""
    say(f"serving on {base} (Ctrl-C to stop). Try:")
    for path in ("/run/latest", "/run/latest/table", "/run/latest/reduce?kind=sum", "/runs", "/nodes"):
        say(f"  curl{header} '{base}{path}'")
    body = example_body(cluster)
    say(f"  curl{header} -X POST '{base}/runs' -H 'Content-Type: application/json' -d '{body}'")


def example_body(cluster: Cluster) -> str:
    """A POST /runs body the model takes: the default question for a language model, else synthetic input."""
    if cluster.tokenizer is None:
        return '{"seq": 16, "seed": 1}'
    fields = {**default_question(cluster.tokenizer.chat_template is not None), "max_new_tokens": 32}
    return msgspec.json.encode(fields).decode()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.exit_with_parent is not None:
        die_with_parent(args.exit_with_parent)
    sys.exit(asyncio.run(_main_with_signals(args)))


async def _main_with_signals(args: argparse.Namespace) -> int:
    """Run amain; SIGINT or SIGTERM cancels it, so every `finally` stops the workers."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    got: list[int] = []

    def stop(sig: int) -> None:
        got.append(sig)
        task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig)
    parent, stop_as_term = args.exit_with_parent, functools.partial(stop, signal.SIGTERM)
    # Held here to the end: the loop keeps only a weak reference to a task.
    watching = None if parent is None else watch_parent(parent, stop_as_term)
    try:
        return await amain(args)
    except asyncio.CancelledError:
        if not got:
            raise
        say(f"rlx-cluster: stopped by {signal.Signals(got[0]).name}; workers stopped")
        return 128 + got[0]
    finally:
        if watching is not None:
            watching.cancel()
        with suppress(Exception):
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
