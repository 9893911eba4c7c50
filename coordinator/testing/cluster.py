"""A handle on a real coordinator process and its workers: HTTP, runs, stages, faults and events.

Every method blocks for a bounded time and is safe to call from a thread; `handle.aio`
has the same methods as coroutines for asyncio tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from coordinator.testing.aio import AsyncRlxCluster
from coordinator.testing.process import CoordinatorProcess, wait_until
from coordinator.testing.sse import EVENTS_S, Frames, SseEvent, events_path

DEFAULT_MODEL = "fake:layers=4,delay_ms=5"
# Seconds for the coordinator to launch its workers and start serving.
READY_S = 60.0
# Seconds one HTTP request may take.
HTTP_TIMEOUT_S = 10.0
# Seconds `wait` gives a run to reach the status asked for.
RUN_WAIT_S = 30.0
FINAL = ("ok", "failed", "interrupted", "cancelled")
TOKEN_ENV = "RLX_CLUSTER_TOKEN"
_SERVING = re.compile(r"serving on (http://\S+) ")
_AIMED = re.compile(r"@(\d+)=")


class Response(NamedTuple):
    """An HTTP answer: status, body (JSON decoded when it is JSON, else text), headers."""

    status: int
    body: Any
    headers: dict[str, str]


class Stage(NamedTuple):
    """A stage as /nodes shows it: its index, worker address and pid, layers and state."""

    index: int
    addr: str
    pid: int
    layers: tuple[int, int]
    state: str


def cli_options(options: Mapping[str, object]) -> list[str]:
    """`forward_timeout=1, verbose=True` as `--forward-timeout 1 --verbose` (False and None are left out)."""
    argv: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)]
    return argv


def with_faults(model: str, stages: int, faults: Mapping[int, Mapping[str, object]]) -> str:
    """The fake model spec with each stage's knobs (by stage index) written as `knob@FIRST_LAYER=value`."""
    if not faults:
        return model
    if model.partition(":")[0] != "fake":
        raise ValueError(f"faults need a fake model (fake:...), got {model!r}")
    # Imported here: the plugin loads in every pytest run, these only when a cluster has faults.
    from coordinator.plan.split import split
    from workers.fake import stage_knobs

    starts = [r.start for r in split(stage_knobs(model).layers, stages)]
    items = []
    for index, knobs in sorted(faults.items()):
        if not 0 <= index < stages:
            raise ValueError(f"faults name stage {index}, but there are {stages} stages (0..{stages - 1})")
        items += [f"{knob}@{starts[index]}={value}" for knob, value in knobs.items()]
    return ",".join([model, *items])


class RlxCluster:
    """A coordinator process serving the API at `base_url`, with the token `token` ("" for none)."""

    def __init__(self, process: CoordinatorProcess, token: str, model: str) -> None:
        self.process, self.token, self.model = process, token, model
        self._base_url = ""
        self.paused: set[int] = set()

        self.aio = AsyncRlxCluster(self)

    @classmethod
    def start(
        cls,
        model: str = DEFAULT_MODEL,
        stages: int = 2,
        *,
        faults: Mapping[int, Mapping[str, object]] | None = None,
        token: str = "",
        command: str = "serve",
        ready: bool = True,
        ready_timeout: float = READY_S,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        prefix: Sequence[str] = (),
        **options: object,
    ) -> RlxCluster:
        """Start `rlx-cluster COMMAND` on a free loopback port; with `ready`, wait until it serves.

        `options` are the command's options by name (`db`, `forward_timeout`, `verbose`, ...);
        `faults` maps a stage index to fake knobs for that stage alone, e.g. {1: {"crash_on": 2}}.
        """
        spec = with_faults(model, stages, faults or {})
        options = {"db": ":memory:", **options}
        if command == "serve" or options.get("serve"):
            options.setdefault("http", "127.0.0.1:0")  # the port is read from what it says
        argv = [command, "--model", spec, "--stages", str(stages), *cli_options(options)]
        cluster = cls.launch(argv, token=token, env=env, cwd=cwd, prefix=prefix)
        if ready:
            try:
                cluster.ready(ready_timeout)
            except BaseException:
                cluster.stop()
                raise
        return cluster

    @classmethod
    def launch(
        cls,
        argv: Sequence[str],
        *,
        token: str = "",
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        prefix: Sequence[str] = (),
    ) -> RlxCluster:
        """Start `rlx-cluster ARGV` as written (run `prefix` first, e.g. setpriv); returns at once."""
        full_env = {**os.environ, **(env or {})}
        full_env.pop(TOKEN_ENV, None)
        if token:
            full_env[TOKEN_ENV] = token  # not on the command line, where `ps` shows it
        model = argv[argv.index("--model") + 1] if "--model" in argv[:-1] else ""
        return cls(CoordinatorProcess(argv, full_env, cwd, prefix), token, model)

    @property
    def base_url(self) -> str:
        """`http://host:port` the coordinator said it serves on ("" until it has)."""
        if not self._base_url and (found := _SERVING.search(self.process.stderr)):
            self._base_url = found.group(1)
        return self._base_url

    def ready(self, timeout: float = READY_S) -> RlxCluster:
        """Wait until the coordinator serves; check each stage holds the layers its faults were aimed at."""
        self.process.said("serving on", timeout)
        starts = {s.layers[0] for s in self.stages()}
        missed = sorted({int(layer) for layer in _AIMED.findall(self.model)} - starts)
        if missed:
            raise AssertionError(f"no stage starts at layer(s) {missed} that {self.model!r} aims knobs at")
        return self

    @property
    def pid(self) -> int:
        """The coordinator's process id."""
        return self.process.pid

    @property
    def stderr(self) -> str:
        return self.process.stderr

    @property
    def stdout(self) -> str:
        return self.process.stdout

    def said(self, text: str, timeout: float = 30.0) -> None:
        """Wait until the coordinator prints `text`."""
        self.process.said(text, timeout)

    def request(
        self, method: str, path: str, body: object = None, timeout: float = HTTP_TIMEOUT_S
    ) -> Response:
        """Send one request (JSON `body`, the token if any); any status is an answer, not an exception."""
        if not self.base_url:
            raise RuntimeError("the coordinator is not serving yet: wait for ready() first")
        data = None if body is None else json.dumps(body).encode()
        headers = self._headers() if data is None else {**self._headers(), "Content-Type": "application/json"}
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return _response(r.status, r.read(), r.headers)
        except urllib.error.HTTPError as exc:
            with exc:
                return _response(exc.code, exc.read(), exc.headers)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def get(self, path: str) -> Response:
        return self.request("GET", path)

    def post(self, path: str, body: object = None) -> Response:
        return self.request("POST", path, {} if body is None else body)

    def delete(self, path: str) -> Response:
        return self.request("DELETE", path)

    def nodes(self) -> list[dict]:
        """GET /nodes: each stage's report and state."""
        return _expect(self.get("/nodes"), 200, "GET /nodes")["nodes"]

    def stages(self) -> list[Stage]:
        """Each stage's address, worker pid, layers and state, from /nodes."""
        return [
            Stage(n["stage"], n.get("addr", ""), n.get("pid", 0), (n["layers"]["start"], n["layers"]["end"]),
                  n["state"])
            for n in self.nodes()
        ]  # fmt: skip

    def post_run(self, **body: object) -> int:
        """POST /runs with `body` (e.g. seq=4); the new run's id (an AssertionError on any answer but 202)."""
        return _expect(self.post("/runs", body), 202, "POST /runs")["id"]

    def run(self, run_id: int | str = "latest") -> dict:
        """The run as served (GET /runs/ID, or /run/latest)."""
        path = "/run/latest" if run_id == "latest" else f"/runs/{run_id}"
        return _expect(self.get(path), 200, f"GET {path}")

    def wait(self, run_id: int, status: str | Iterable[str] = "ok", timeout: float = RUN_WAIT_S) -> dict:
        """Wait until the run's status is `status` (or one of them); fail early if it ends otherwise."""
        wanted = {status} if isinstance(status, str) else set(status)
        seen: list[dict] = []

        def reached() -> dict | None:
            run = self.run(run_id)
            seen[:] = [run]
            if run["status"] in wanted:
                return run
            if run["status"] in FINAL:
                raise AssertionError(f"run {run_id} ended {run['status']} ({run.get('error')}), not {wanted}")
            return None

        try:
            return wait_until(reached, timeout, f"run {run_id} to be {' or '.join(sorted(wanted))}")
        except AssertionError as exc:
            last = seen[0]["status"] if seen else "unknown"
            raise AssertionError(f"{exc}; it is {last}") from None

    def stage_pid(self, index: int) -> int:
        """The pid of the worker holding stage `index` now."""
        stages = self.stages()
        if not 0 <= index < len(stages):
            raise ValueError(f"no stage {index}: stages are 0..{len(stages) - 1}")
        if not stages[index].pid:
            raise AssertionError(f"stage {index} has no worker now (it is {stages[index].state})")
        return stages[index].pid

    def kill_stage(self, index: int, sig: int = signal.SIGKILL) -> int:
        """Send `sig` to stage `index`'s worker; its pid."""
        pid = self.stage_pid(index)
        os.kill(pid, sig)
        return pid

    def pause_stage(self, index: int) -> int:
        """Stop stage `index`'s worker (SIGSTOP) until resume_stage; its pid."""
        pid = self.kill_stage(index, signal.SIGSTOP)
        self.paused.add(pid)
        return pid

    def resume_stage(self, index: int) -> int:
        """Continue stage `index`'s worker (SIGCONT); its pid."""
        pid = self.kill_stage(index, signal.SIGCONT)
        self.paused.discard(pid)
        return pid

    def events(
        self, *, run: int | None = None, kinds: Iterable[str] = (), since: str | int | None = None,
        timeout: float = EVENTS_S,
    ) -> Iterator[SseEvent]:  # fmt: skip
        """Read /events as they come (after event id `since`, or 0: all); AssertionError past `timeout` s."""
        req = urllib.request.Request(self.base_url + events_path(run, kinds, since), headers=self._headers())
        deadline = time.monotonic() + timeout
        try:
            stream = urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as exc:
            with exc:
                raise AssertionError(f"GET /events answered {exc.code}: {exc.read()[:500]!r}") from None
        with stream:
            frames = Frames()
            while True:
                try:
                    line = stream.readline()
                except TimeoutError:
                    line = None
                if line is None or time.monotonic() > deadline:
                    raise AssertionError(f"no more events within {timeout:g}s")
                if not line:
                    return
                if (event := frames.feed(line)) is not None:
                    yield event

    def signal(self, sig: int) -> None:
        """Send `sig` to the coordinator."""
        self.process.send_signal(sig)

    def exit_code(self, timeout: float = 30.0) -> int:
        """Wait for the coordinator to exit; its status."""
        return self.process.exit_code(timeout)

    def stop(self) -> list[int]:
        """Stop the coordinator (paused workers continued first); the pids of workers that outlived it."""
        for pid in self.paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.paused.clear()
        return self.process.stop()


def _response(status: int, raw: bytes, headers) -> Response:
    kind = headers.get("Content-Type", "")
    body = json.loads(raw) if raw and kind.startswith("application/json") else raw.decode(errors="replace")
    return Response(status, body, dict(headers))


def _expect(response: Response, status: int, what: str) -> Any:
    if response.status != status:
        raise AssertionError(f"{what} answered {response.status}, not {status}: {response.body}")
    return response.body
