"""Execute queued runs one at a time on the live pipeline and keep their records.

A run is stored when it is queued, saved when it starts, and committed with
its final status before anyone is told it finished. While it runs, the live
record (stages finished so far) is `Runner.latest`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Annotated

import msgspec
import numpy as np

from coordinator.pipeline import Pipeline, StageFailed
from coordinator.stats import ClusterRun, StageTiming
from coordinator.store import RunStore
from workers.models.synthetic import make_input

log = logging.getLogger("coordinator.runner")

DEFAULT_SEQ = 16
QUEUE_LIMIT = 1000


class RunRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What to run: `seq`/`seed` for a model fed activations, `prompt` for a language model.

    seq: positions in the synthetic input (default 16).
    seed: seeds the synthetic input, or sampling.
    prompt: text to continue (language models).
    max_new_tokens: tokens to generate at most.
    temperature: 0 is greedy; above 0 samples.
    top_k: sample among the k most likely tokens (0 = all).
    chat: wrap the prompt as a user turn in the model's chat template.
    """

    seq: Annotated[int, msgspec.Meta(ge=1, le=65536)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=100_000)] | None = None
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 32
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.0
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    chat: bool = False


class QueueFull(Exception):
    """Too many runs are waiting."""


class Runner:
    """Owns the run queue; executes runs in order on one pipeline."""

    def __init__(self, pipeline: Pipeline, store: RunStore, tokenizer=None) -> None:
        self.pipeline = pipeline
        self.store = store
        self.tokenizer = tokenizer
        self.latest: ClusterRun | None = None
        self.on_text: Callable[[str], None] | None = None
        self._queue: asyncio.Queue[tuple[ClusterRun, RunRequest]] = asyncio.Queue()
        self._finished: dict[int, asyncio.Future[ClusterRun]] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Mark runs a previous coordinator left unfinished, then start executing."""
        n = await self.store.interrupt_unfinished()
        if n:
            log.warning("%d run(s) left unfinished by a previous coordinator marked interrupted", n)
        self.latest = await self.store.latest()
        self._task = asyncio.create_task(self._loop())

    def check(self, req: RunRequest) -> None:
        """Refuse a request this model cannot run, saying why."""
        if self.pipeline.info.input == "tokens":
            if req.prompt is None:
                raise ValueError(f"model {self.pipeline.info.name!r} takes a prompt: send {{\"prompt\": \"...\"}}")
            if req.seq is not None:
                raise ValueError("seq is for models fed activations; this one takes a prompt")
            if req.chat:
                self.tokenizer.chat(req.prompt)  # raises when the model has no chat template
        elif req.prompt is not None:
            raise ValueError(f"model {self.pipeline.info.name!r} takes no prompt: send {{\"seq\": N, \"seed\": S}}")

    async def submit(self, req: RunRequest) -> ClusterRun:
        """Store a queued run and put it in line; return its record."""
        self.check(req)
        if self._queue.qsize() >= QUEUE_LIMIT:
            raise QueueFull(f"{QUEUE_LIMIT} runs are already waiting")
        run = ClusterRun(
            timings=[],
            total_forward_ms=0.0,
            output=[],
            status="queued",
            model=self.pipeline.info.name,
            created_at=time.time(),
            seq=req.seq or (0 if req.prompt else DEFAULT_SEQ),
            prompt=req.prompt,
        )
        await self.store.create(run)
        self._finished[run.id] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((run, req))
        return run

    async def run(self, req: RunRequest) -> ClusterRun:
        """Submit a run and wait until it is finished and stored."""
        run = await self.submit(req)
        return await asyncio.shield(self._finished[run.id])

    def queued(self) -> int:
        """Runs waiting to start."""
        return self._queue.qsize()

    async def _loop(self) -> None:
        while True:
            run, req = await self._queue.get()
            await self._execute(run, req)

    async def _execute(self, run: ClusterRun, req: RunRequest) -> None:
        session = f"run-{run.id}"
        run.status = "running"
        self.latest = run
        await self.store.save(run)
        status, error = "ok", None
        try:
            if self.pipeline.info.input == "tokens":
                await self._generate(run, req, session)
            else:
                await self._forward_once(run, req, session)
        except StageFailed as exc:
            status, error = "failed", str(exc)
        except asyncio.CancelledError:
            await self._finish(run, "interrupted", "the coordinator stopped during the run")
            raise
        except Exception as exc:  # a bug must fail the run, not the coordinator
            log.exception("run %d failed", run.id)
            status, error = "failed", f"{type(exc).__name__}: {exc}"
        with suppress(Exception):
            await self.pipeline.reset(session)
        await self._finish(run, status, error)

    async def _finish(self, run: ClusterRun, status: str, error: str | None) -> None:
        final = msgspec.structs.replace(run, status=status, error=error, finished_at=time.time())
        await self.store.save(final)
        self.latest = final if self.latest is run else self.latest
        if error:
            log.error("run %d %s: %s", run.id, status, error)
        fut = self._finished.pop(run.id, None)
        if fut is not None and not fut.done():
            fut.set_result(final)

    async def _forward_once(self, run: ClusterRun, req: RunRequest, session: str) -> None:
        info = self.pipeline.info
        x = make_input(run.seq, info.hidden, req.seed)
        started = time.monotonic()
        y = await self.pipeline.forward(x, session=session, start_pos=0, on_stage=run.timings.append)
        run.total_forward_ms = (time.monotonic() - started) * 1000
        run.output = await asyncio.to_thread(lambda: y.ravel().tolist())

    async def _generate(self, run: ClusterRun, req: RunRequest, session: str) -> None:
        from workers.models.generate import sample

        tok = self.tokenizer
        ids = tok.encode(tok.chat(req.prompt) if req.chat else req.prompt)
        if not ids:
            raise StageFailed("the prompt encodes to no tokens")
        room = self.pipeline.info.context_length - len(ids)
        if room < 1:
            raise StageFailed(f"the prompt has {len(ids)} tokens; the context holds {self.pipeline.info.context_length}")
        run.seq = len(ids)
        rng = np.random.default_rng(req.seed)
        stream = tok.stream()
        run.text = ""

        def emit(token: int | None) -> None:
            if token is None:  # the end: whatever a split character left behind
                piece = stream.flush()
            else:
                run.tokens.append(token)
                piece = stream.push(token)
            run.text += piece
            if self.on_text is not None and piece:
                self.on_text(piece)

        started = time.monotonic()
        logits = await self.pipeline.forward(
            np.asarray(ids, np.int32), session=session, start_pos=0, last_only=True, on_stage=run.timings.append
        )
        run.total_forward_ms = (time.monotonic() - started) * 1000
        token = sample(logits[-1], req.temperature, req.top_k, rng)
        if token == tok.eos_id:
            return
        emit(token)
        decode = ClusterRun(timings=[], total_forward_ms=0.0, output=[], status="running", seq=0)
        run.decode = decode
        started = time.monotonic()
        pos = len(ids)
        for _ in range(min(req.max_new_tokens, room) - 1):
            logits = await self.pipeline.forward(
                np.asarray([token], np.int32),
                session=session,
                start_pos=pos,
                last_only=True,
                on_stage=lambda t: _accumulate(decode.timings, t),
            )
            pos += 1
            decode.seq += 1
            decode.total_forward_ms = (time.monotonic() - started) * 1000
            token = sample(logits[-1], req.temperature, req.top_k, rng)
            if token == tok.eos_id:
                break
            emit(token)
        decode.status = "ok"
        emit(None)

    async def close(self) -> None:
        """Stop executing: the run in progress is stored as interrupted, queued ones too."""
        if self._task is not None:
            while not self._task.done():  # cancel again if a cancellation was swallowed
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=1.0)
            with suppress(asyncio.CancelledError):
                await self._task
        while not self._queue.empty():
            run, _ = self._queue.get_nowait()
            await self._finish(run, "interrupted", "the coordinator stopped before the run started")


def _accumulate(timings: list[StageTiming], t: StageTiming) -> None:
    """Add one decode step's stage timing to the per-stage sums."""
    for i, s in enumerate(timings):
        if s.stage == t.stage:
            timings[i] = msgspec.structs.replace(
                s, forward_ms=s.forward_ms + t.forward_ms, compute_ms=s.compute_ms + t.compute_ms
            )
            return
    timings.append(t)
