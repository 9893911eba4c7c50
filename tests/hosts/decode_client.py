"""Time generations from inside a test host: `python decode_client.py BODY RUNS TIMEOUT_S URL...`.

Posts BODY (a run's JSON) to each URL/runs in turn, RUNS rounds, one run at a
time (each waited for by polling its record a few times a second), so every
coordinator's runs meet the same load; in this one process:
a process started for every poll would take a core's share from the stages
being timed. Prints one JSON line: per run, its status, its decode tokens/s
and per stage the decode's forward_ms and compute_ms a token, a list for
each URL. The bearer
token comes from $RLX_CLUSTER_TOKEN. Standard library only: it runs with `python -I`.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

POLL_S = 0.2
REQUEST_TIMEOUT_S = 15.0


def call(method: str, url: str, body: bytes | None = None) -> dict:
    req = urllib.request.Request(url, data=body, method=method)
    req.add_header("Authorization", f"Bearer {os.environ['RLX_CLUSTER_TOKEN']}")
    if body is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        return json.loads(resp.read())


def one(base: str, body: bytes, timeout: float) -> dict:
    run_id = call("POST", f"{base}/runs", body)["id"]
    deadline = time.monotonic() + timeout
    while (run := call("GET", f"{base}/runs/{run_id}"))["status"] in ("queued", "running"):
        if time.monotonic() > deadline:
            return {"status": f"not finished within {timeout}s", "id": run_id}
        time.sleep(POLL_S)
    decode = run.get("decode") or {}
    seq = decode.get("seq") or 1
    return {"status": run["status"], "id": run_id, "error": run.get("error"),
            "tokens_per_s": decode.get("tokens_per_s", 0.0),
            "forward_ms": [t["forward_ms"] / seq for t in decode.get("timings", [])],
            "compute_ms": [t["compute_ms"] / seq for t in decode.get("timings", [])]}  # fmt: skip


def main() -> None:
    body, runs, timeout, bases = sys.argv[1].encode(), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
    timed: list[list[dict]] = [[] for _ in bases]
    for _ in range(runs):
        for base, runs_of in zip(bases, timed, strict=True):
            runs_of.append(one(base, body, timeout))
    print(json.dumps(timed))


if __name__ == "__main__":
    main()
