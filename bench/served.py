"""Decode as a user gets it: a coordinator serving SmolLM2 on one stage, a run posted over HTTP.

The coordinator is started as a user starts it (`python -m coordinator run
--serve`), in a process of its own with the thread variables it is given, and
its worker as the coordinator launches it. A short run warms it up; the timed
run's prefill and decode tokens/s are the ones `/runs/{id}` serves, its decode
the wall time of the decode steps on the coordinator's clock (sampling and
the hop included). Beside them, each process's CPU time and run-queue delay
per decode step (/proc/<pid>/task/*/schedstat), which a shared machine's
noise does not blur as it does wall times.
"""

from __future__ import annotations

import glob
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.model import MODEL, prompt_ids
from workers import models
from workers.models.tokenizer import load_tokenizer

SERVE_TIMEOUT_S = 300.0  # the coordinator's start: the worker's build and the API bound
RUN_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 30.0
POLL_S = 0.25
STOP_GRACE_S = 30.0
WARM_TOKENS = 4
NS_PER_MS = 1e6


@contextmanager
def serving(
    env: dict[str, str], model: str = MODEL, stages: int = 1, precision: str = "packed"
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A coordinator serving `model` on `stages` stages with `env`; its API's base URL and process."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [sys.executable, "-m", "coordinator", "run", "--model", model, "--stages", str(stages),
            "--plan", "even", "--precision", precision, "--db", ":memory:", "--serve",
            "--http", f"127.0.0.1:{port}"]  # fmt: skip
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tail: deque[str] = deque(maxlen=15)
    up = threading.Event()

    def drain() -> None:  # read stderr to the end, so that the coordinator never blocks on a full pipe
        assert proc.stderr is not None
        for line in proc.stderr:
            tail.append(line.rstrip())
            if "serving on" in line:
                up.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        if not up.wait(SERVE_TIMEOUT_S):
            raise SystemExit(f"`{' '.join(args[1:])}` did not serve within {SERVE_TIMEOUT_S:.0f}s:\n"
                             + "\n".join(tail))  # fmt: skip
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_GRACE_S)
        reader.join(STOP_GRACE_S)


def _http(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as reply:
        return json.loads(reply.read())


def run(base: str, prompt: str, new_tokens: int, poll_s: float = POLL_S, **sampling: float) -> dict:
    """Post a run (greedy unless `sampling` says) and poll it until it ends; as `/runs/{id}` serves it."""
    body = {"prompt": prompt, "max_new_tokens": new_tokens, **sampling}
    rid = _http(f"{base}/runs", body)["id"]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (view := _http(f"{base}/runs/{rid}"))["status"] in ("queued", "running"):
        if time.monotonic() > deadline:
            raise SystemExit(f"run {rid} did not finish within {RUN_TIMEOUT_S:.0f}s")
        time.sleep(poll_s)
    if view["status"] != "ok":
        raise SystemExit(f"run {rid} ended {view['status']}: {view.get('error')}")
    return view


def schedstat(pid: int) -> tuple[int, int]:
    """A process's CPU time and run-queue delay so far, ns, summed over its threads alive now."""
    cpu = delay = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            on_cpu, waited, _ = map(int, Path(path).read_text().split())
        except (OSError, ValueError):  # a thread that ended as it was read
            continue
        cpu, delay = cpu + on_cpu, delay + waited
    return cpu, delay


def resident(pid: int) -> int:
    """A process's resident set now, bytes (VmRSS of /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"process {pid} reports no VmRSS")


def worker_pids(coordinator: int) -> list[int]:
    """The workers the coordinator started."""
    return [int(pid) for path in glob.glob(f"/proc/{coordinator}/task/*/children")
            for pid in Path(path).read_text().split()]  # fmt: skip


def worker_pid(coordinator: int) -> int:
    """The one worker the coordinator started."""
    kids = worker_pids(coordinator)
    if len(kids) != 1:
        raise SystemExit(f"the coordinator has {len(kids)} child processes, not its one worker")
    return kids[0]


def prompt_text(prompt_tokens: int, model: str = MODEL) -> str:
    """The in-process bench's prompt ids as text (they encode back to about as many tokens).

    Its BOS is left out: the coordinator puts it back when the file's prompts start with one.
    """
    tokenizer = load_tokenizer(models.gguf_path(model))
    ids = [int(i) for i in prompt_ids(prompt_tokens, model)]
    if tokenizer.add_bos and ids[:1] == [tokenizer.bos_id]:
        ids = ids[1:]
    return tokenizer.decode(ids)


def served_decode(
    env: dict[str, str], prompt_tokens: int = 128, new_tokens: int = 32, model: str = MODEL
) -> dict:
    """One timed run through a fresh coordinator started with `env`, after a warm-up run."""
    prompt = prompt_text(prompt_tokens, model)
    with serving(env, model) as (base, proc):
        pids = {"coordinator": proc.pid, "worker": worker_pid(proc.pid)}
        run(base, prompt, WARM_TOKENS)
        # A run of the prompt alone, then the timed one: what the second costs beyond the first is its
        # decode steps', however much the prompt's forward took.
        spent = []
        for tokens in (1, new_tokens):
            before = {k: schedstat(pid) for k, pid in pids.items()}
            view = run(base, prompt, tokens)
            spent.append({k: [b - a for a, b in zip(before[k], schedstat(pid), strict=True)]
                          for k, pid in pids.items()})  # fmt: skip
        worker_resident = resident(pids["worker"])
    decode = view["decode"]
    steps = max(1, decode["seq"])

    def per_step(i: int) -> dict[str, float]:  # 0: CPU time, 1: run-queue delay
        return {k: round((spent[1][k][i] - spent[0][k][i]) / NS_PER_MS / steps, 2) for k in pids}

    timing = decode["timings"][0]
    return {
        "prompt_tokens": view["seq"],
        "new_tokens": len(view["tokens"]),
        "prefill_tok_s": round(view["tokens_per_s"], 1),
        "decode_tok_s": round(decode["tokens_per_s"], 1),
        "decode_compute_ms": round(timing["compute_ms"] / steps, 2),
        "decode_forward_ms": round(timing["forward_ms"] / steps, 2),
        "cpu_ms_per_step": per_step(0),
        "run_delay_ms_per_step": per_step(1),
        "worker_resident_bytes": worker_resident,
        "tokens": view["tokens"],
    }
