"""The chaos soak's SIGTERM under load: a coordinator with runs queued and running, streamed /v1 chats open
and /events streams that never read, signalled to stop.

It must exit within EXIT_BOUND_S with status 128+15, leave no worker behind, and lose no run: every run the
API accepted (a 202 from POST /runs, a streamed chat's run) is in the store file with a final status, none
queued or running, and a coordinator started again on the same file lists each with the same status.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from contextlib import ExitStack, closing, suppress
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from coordinator.api.server import SHUTDOWN_GRACE_S
from coordinator.launch.base import KILL_WAIT, TERM_GRACE
from tests.conftest import eventually, worker_pids
from tests.support.chaos import UNFINISHED, Http, Log, api_runs, stored_runs
from tests.support.serving import Serve, serving
from tests.support.tiny_chat import PROMPT

# The bound on exiting after SIGTERM: the server's grace for the responses still running, then each worker
# stopped in its bounded steps (SIGTERM, TERM_GRACE, SIGKILL, KILL_WAIT), all stopped at once.
EXIT_BOUND_S = SHUTDOWN_GRACE_S + TERM_GRACE + KILL_WAIT
FINAL = ("ok", "failed", "cancelled", "interrupted")
STOP_STAGES = 2
CHATS = 3
STALLED = 4
POSTED = 8  # more than the runner's MAX_ACTIVE, so that some wait queued
LONG_RUN = 600  # tokens: runs that are far from done when the signal comes
SMALL_RCVBUF = 4096


@dataclass
class Stop:
    """What a SIGTERM under load did, as evidence for the judge.

    took: seconds from the signal to the exit; code: the exit status.
    busy: the runs' statuses as the API listed them just before the signal.
    workers: the coordinator's workers before the signal; alive: those still there after its exit.
    accepted: every run id the API accepted; stored: each run's status in the file after the exit;
    listed: each run's status as a coordinator started again on the file lists it.
    chat_ends: the last two `data:` of each streamed chat.
    """

    took: float = 0.0
    code: int | None = None
    busy: dict[int, str] = field(default_factory=dict)
    workers: list[int] = field(default_factory=list)
    alive: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    stored: dict[int, str] = field(default_factory=dict)
    listed: dict[int, str] = field(default_factory=dict)
    chat_ends: list[list] = field(default_factory=list)


def judge_stop(stop: Stop, bound: float = EXIT_BOUND_S) -> list[str]:
    """Everything the SIGTERM under load did wrong, or did not test."""
    wrong = []
    if stop.code != 128 + signal.SIGTERM:
        wrong.append(f"exit status {stop.code} on SIGTERM, not {128 + signal.SIGTERM}")
    if stop.took > bound:
        wrong.append(f"exited {stop.took:.2f} s after SIGTERM, past its bound of {bound:g} s")
    busy = set(stop.busy.values())
    if not {"queued", "running"} <= busy:
        wrong.append(f"not under load: just before the signal the runs were {sorted(busy)}")
    if not stop.workers:
        wrong.append("no worker was seen before the signal")
    wrong += [f"worker {pid} outlived the coordinator" for pid in stop.alive]
    for run_id in stop.accepted:
        if run_id not in stop.stored:
            wrong.append(f"run {run_id} was accepted but is not in the file")
        elif stop.stored[run_id] not in FINAL:
            wrong.append(f"run {run_id} is {stop.stored[run_id]} in the file")
    wrong += [f"run {i} is {s} in the file" for i, s in stop.stored.items()
              if s in UNFINISHED and i not in stop.accepted]  # fmt: skip
    for run_id, status in stop.stored.items():
        if stop.listed.get(run_id) != status:
            wrong.append(f"run {run_id} is {status} in the file, {stop.listed.get(run_id)} once restarted")
    for end in stop.chat_ends:
        if end[-1:] != ["[DONE]"] or "interrupted" not in json.dumps(end[:1]):
            wrong.append(f"a streamed chat did not end interrupted: {json.dumps(end)[:300]}")
    return wrong


def stalled_stream(port: int) -> socket.socket:
    """A client that asks for /events and never reads a byte of the answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RCVBUF)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return sock


async def read_chat(response: aiohttp.ClientResponse, run_ids: list[int], started: asyncio.Event) -> list:
    """A streamed chat's `data:` lines, decoded ([DONE] as the string); its run's id once the first came."""
    got: list = []
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        got.append(data if data == "[DONE]" else json.loads(data))
        if len(got) == 1 and isinstance(got[0], dict) and str(got[0].get("id", "")).startswith("chatcmpl-"):
            run_ids.append(int(got[0]["id"].removeprefix("chatcmpl-")))
        if isinstance(got[-1], dict) and any(c["delta"].get("content") for c in got[-1].get("choices", [])):
            started.set()
    return got


async def chats(serve: Serve, session: aiohttp.ClientSession, stop: Stop) -> list[asyncio.Future]:
    """Open CHATS streamed chat completions; their readers, once each has streamed some text."""
    _, models, _ = await serve.get("/v1/models")
    body = {"model": models["data"][0]["id"], "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": LONG_RUN, "stream": True, "temperature": 0}  # fmt: skip
    responses = [await session.post("/v1/chat/completions", json=body) for _ in range(CHATS)]
    assert [r.status for r in responses] == [200] * CHATS, [r.status for r in responses]
    started = [asyncio.Event() for _ in responses]
    readers = [asyncio.ensure_future(read_chat(r, stop.accepted, s))
               for r, s in zip(responses, started, strict=True)]  # fmt: skip
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
    return readers


async def under_load(serve: Serve, http: Http, stop: Stop) -> None:
    """Load the coordinator, SIGTERM it and note how it went; the chats' ends too."""
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(serve.cluster.base_url, timeout=timeout) as session:
        with ExitStack() as stalled:
            for _ in range(STALLED):
                stalled.enter_context(closing(stalled_stream(serve.port)))
            readers = await chats(serve, session, stop)
            for _ in range(POSTED):
                reply = await http.call("POST", "/runs", {"prompt": PROMPT, "max_new_tokens": LONG_RUN})
                if reply is not None and reply.status == 202:
                    stop.accepted.append(reply.body["id"])
            listed = await http.call("GET", "/runs?limit=100")
            if listed is not None and listed.status == 200:
                stop.busy = {r["id"]: r["status"] for r in listed.body["runs"]}
            stop.workers = worker_pids(serve.proc.pid)
            signalled = time.monotonic()
            serve.proc.send_signal(signal.SIGTERM)
            with suppress(TimeoutError):  # the judge says so; serving kills it
                stop.code = await serve.exit_code(2 * EXIT_BOUND_S)
            stop.took = time.monotonic() - signalled
            stop.alive = [pid for pid in stop.workers if os.path.exists(f"/proc/{pid}")]
            done = await asyncio.wait_for(asyncio.gather(*readers, return_exceptions=True), EXIT_BOUND_S)
    stop.chat_ends = [d[-2:] if isinstance(d, list) else [repr(d)] for d in done]


async def relisted(args: tuple[str, ...], log: Log) -> dict[int, str]:
    """Every run's status as a coordinator started again with `args` lists it, page by page."""
    async with serving(*args) as again:
        await again.said("serving on", 60)
        http = Http(again.port, log)
        try:
            return await api_runs(http)
        finally:
            await http.close()


async def sigterm_under_load(model: Path, db: Path, log: Log) -> Stop:
    """The whole phase: serve `model` on `db`, SIGTERM it under load, read the file, start again, list."""
    args = ("--model", str(model), "--stages", str(STOP_STAGES), "--plan", "even", "--db", str(db))
    stop = Stop()
    async with serving(*args) as serve:
        await serve.said("serving on", 120)
        await eventually(lambda: ready(serve), 60, "the stop phase's coordinator to be ready")
        http = Http(serve.port, log)
        try:
            await under_load(serve, http, stop)
        finally:
            await http.close()
    stop.stored, disagree = stored_runs(db)
    log.violations += disagree
    stop.listed = await relisted(args, log)
    return stop


async def ready(serve: Serve) -> bool:
    status, _, _ = await serve.get("/healthz")
    return status == 200


def stop_summary(stop: Stop) -> dict:
    """The SIGTERM's figures, as the soak prints them."""
    by_status: dict[str, int] = {}
    for status in stop.stored.values():
        by_status[status] = by_status.get(status, 0) + 1
    busy = sorted(stop.busy.values())
    return {
        "exit_s": round(stop.took, 2), "exit_bound_s": EXIT_BOUND_S, "exit_status": stop.code,
        "busy_at_signal": {s: busy.count(s) for s in set(busy)}, "runs_accepted": len(stop.accepted),
        "runs_by_status": by_status, "relisted": len(stop.listed), "workers": len(stop.workers),
        "workers_left": len(stop.alive), "chats": len(stop.chat_ends), "stalled_streams": STALLED,
    }  # fmt: skip
