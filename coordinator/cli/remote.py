"""`rlx-cluster runs` and `rlx-cluster show`: read a serving coordinator's runs through its HTTP API.

Whatever goes wrong is one line and an exit status: 1 when the coordinator
cannot be reached or fails (try again later), 2 when the request itself is
wrong (no such run, a missing or wrong token).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import msgspec

API_TOKEN_ENV = "RLX_CLUSTER_TOKEN"
URL_ENV = "RLX_CLUSTER_URL"
DEFAULT_URL = "http://127.0.0.1:8470"
REQUEST_TIMEOUT_S = 30.0
DEFAULT_LIMIT = 20
MAX_LIMIT = 1000  # the API's own page limit
NOTE_WIDTH = 40  # characters of a prompt or error shown in `runs`


class RemoteError(Exception):
    """A request the coordinator did not answer as asked; `status` is the exit status it means."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add `runs` and `show` to the command line."""
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument(
        "--url", type=_base_url, default=os.environ.get(URL_ENV, DEFAULT_URL),
        help=f"the serving coordinator (or ${URL_ENV}; default {DEFAULT_URL})",
    )  # fmt: skip
    client.add_argument(
        "--token", default=os.environ.get(API_TOKEN_ENV, ""), help=f"API bearer token (or ${API_TOKEN_ENV})"
    )
    runs = sub.add_parser("runs", parents=[client], help="list a serving coordinator's recent runs")
    runs.add_argument(
        "--limit",
        type=_limit,
        default=DEFAULT_LIMIT,
        help=f"runs to list, newest first (default {DEFAULT_LIMIT})",
    )
    show = sub.add_parser("show", parents=[client], help="show one run of a serving coordinator")
    show.add_argument("run", type=_run_path, metavar="ID|latest", help="a run id, or latest")
    form = show.add_mutually_exclusive_group()
    form.add_argument("--table", dest="json", action="store_false", help="the monitor table (default)")
    form.add_argument("--json", dest="json", action="store_true", help="the run as JSON")
    show.set_defaults(json=False)  # else --table's store_false would make JSON the default
    for parser in (runs, show):
        parser.set_defaults(verbose=False)


def _base_url(text: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text.rstrip("/")) <= len("https://"):
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {text!r}")
    return text.rstrip("/")


def _limit(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"must be a whole number in 1..{MAX_LIMIT}, got {text!r}")
    return int(text)


def _run_path(text: str) -> str:
    """The API path of the run `text` names."""
    if text == "latest":
        return "/run/latest"
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a run id (a whole number >= 1) or latest, got {text!r}")
    return f"/runs/{int(text)}"


async def command(args: argparse.Namespace) -> int:
    """Carry out `runs` or `show`, printing to stdout; RemoteError when the coordinator does not answer."""
    if args.command == "runs":
        page = msgspec.json.decode(await get(args.url, f"/runs?limit={args.limit}", args.token))
        print(runs_table(page["runs"]), end="")
    elif args.json:
        print(msgspec.json.format(await get(args.url, args.run, args.token), indent=2).decode())
    else:
        print(run_summary(msgspec.json.decode(await get(args.url, args.run, args.token))), end="")
    sys.stdout.flush()
    return 0


async def get(base: str, path: str, token: str) -> bytes:
    """The body of GET base+path; RemoteError saying what went wrong otherwise."""
    # Imported here: every command line parses these commands' options, only `runs` and `show` send requests.
    import aiohttp

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session,
            session.get(base + path, headers=headers) as response,
        ):
            body = await response.read()
    except aiohttp.ClientConnectorError as exc:
        # The errno's own words ("Connection refused"), not asyncio's "Connect call failed (...)".
        errno = exc.errno or 0
        why = os.strerror(errno).lower() if errno > 0 else exc.os_error.strerror or str(exc.os_error)
        raise RemoteError(
            f"cannot reach the coordinator at {base}: {why} (is rlx-cluster serving there?)", 1
        ) from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        why = str(exc) or type(exc).__name__
        raise RemoteError(f"the coordinator at {base} did not answer GET {path}: {why}", 1) from None
    if response.status < 400:
        return body
    said = _error_text(body)
    if response.status == 401:
        given = "was refused" if token else "is needed"
        raise RemoteError(f"{base}: a bearer token {given}: pass --token or set ${API_TOKEN_ENV} ({said})", 2)
    raise RemoteError(f"{base}{path}: {said} (HTTP {response.status})", 2 if response.status < 500 else 1)


def _error_text(body: bytes) -> str:
    """What an error response says: its JSON `error`, else its text."""
    try:
        said = msgspec.json.decode(body)["error"]
    except (msgspec.DecodeError, TypeError, KeyError):
        said = body.decode(errors="replace").strip()
    return str(said)[:500] or "no reason given"


def runs_table(runs: list[dict]) -> str:
    """Runs as a table, one line each, newest first."""
    if not runs:
        return "no runs yet\n"
    head = (f"{'id':>6}  {'status':<11} {'model':<24} {'seq':>6} {'gen':>5} {'forward':>9}  "
            f"{'created':<19}  note\n")  # fmt: skip
    return head + "".join(_run_line(run) for run in runs)


def _run_line(run: dict) -> str:
    """One run's line: positions, tokens generated, forward time (prefill and decode), its prompt or error."""
    decode = run.get("decode") or {"seq": 0, "total_forward_ms": 0.0}
    forward_s = (run["total_forward_ms"] + decode["total_forward_ms"]) / 1000
    note = _cut((run.get("error") or run.get("prompt") or "").replace("\n", " "), NOTE_WIDTH)
    return (
        f"{run['id']:>6}  {run['status']:<11} {_cut(run['model'], 24):<24} {run['seq']:>6} "
        f"{decode['seq']:>5} {forward_s:>8.3f}s  {_when(run['created_at']):<19}  {note}\n"
    )


def run_summary(run: dict) -> str:
    """A run for a person: what it was, what it said, then its monitor table."""
    lines = [f"run {run['id']} {run['status']}, model {run['model']}, created {_when(run['created_at'])}\n"]
    if run.get("prompt") is not None:
        lines.append(f"prompt: {run['prompt']}\n")
    if run.get("text") is not None:
        lines.append(f"text: {run['text']}\n")
    if run.get("error"):
        lines.append(f"error: {run['error']}\n")
    lines.append(run["table"])
    return "".join(lines)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _when(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S") if unix else "-"
