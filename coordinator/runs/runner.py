"""Execute queued runs, several at once on the live pipeline, and keep their records.

At most `max_active` runs execute at a time, in the order they were queued;
their forwards go through a Scheduler, which batches the decode steps of runs
in flight into one forward (see coordinator.runs.scheduler). Each run keeps its own
record, timings, events and cancel.

A run is stored when it is queued, saved when it starts, and committed with
its final status before anyone is told it finished. While it runs, its live
record (stages finished so far) is `Runner.live(id)`; `Runner.latest` is the
run started last, live while it runs, as stored once it ended. A request the
model cannot take is refused when submitted, with a ValueError saying why (see
coordinator.runs.requests). A run that cannot go through now (a stage not up, a
failing store, a full queue) is refused with Unavailable.

The runner outlives a failing store: a run whose save fails ends `failed` (its
record kept by the store and written when it works again), and a queued run
starts only once the store works.

Each run is told to the cluster's event bus: queued when submitted, started,
and finished once its end is stored. A run can be cancelled: a queued one
leaves the queue, a running one stops at the next forward boundary (see
coordinator.runs.recorder); either is stored `cancelled` and its session dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from coordinator.errors import Unavailable
from coordinator.events import RunFinished, RunQueued, RunStarted
from coordinator.runs.generation import PREFILL_CHUNK, Sampling, TextCallback, forward_once, generate
from coordinator.runs.progress import Progress
from coordinator.runs.recorder import Recorder, RunCancelled
from coordinator.runs.requests import RunRequest, check, encode_prompt, queued_run
from coordinator.runs.resume import Identity, restore
from coordinator.runs.scheduler import LANES, Scheduler
from coordinator.stages.pipeline import Pipeline, StageFailed
from coordinator.stats import ClusterRun, RunStatus
from coordinator.store.history import RunStore, StoreError, StoreUnavailable

if TYPE_CHECKING:
    from workers.models.tokenizer import Tokenizer

log = logging.getLogger("coordinator.runs.runner")

# Runs waiting to start; one more is refused with 503 (QueueFull).
QUEUE_LIMIT = 1000
# Runs executing at once; their decode steps share forwards.
MAX_ACTIVE = 4
# Seconds close() lets the runs in progress store their end before cancelling again.
CLOSE_GRACE_S = 10.0


class QueueFull(Unavailable):
    """Too many runs are waiting."""


class RunFinishedError(Exception):
    """The run has already finished: there is nothing to cancel (HTTP 409)."""


@dataclass
class _Job:
    """A queued run and what executing it needs.

    prompt_ids: a language model's prompt as token ids, encoded when submitted.
    on_text: told each piece of generated text as it is decoded.
    recorder: times its forwards, and carries a cancel to the next forward boundary.
    """

    run: ClusterRun
    req: RunRequest
    prompt_ids: list[int]
    on_text: TextCallback | None
    recorder: Recorder


class Runner:
    """Owns the run queue; executes up to `max_active` runs at once on one pipeline and tells its bus.

    prefill_chunk: positions of a prompt forwarded at once at most (see coordinator.runs.generation).
    identity: the model and plan its runs are stored under (default: the pipeline's model spec and
        layers); resume: take over the runs a coordinator that is gone left unfinished under the same
        identity, instead of marking them interrupted (see coordinator.runs.resume).
    """

    def __init__(
        self, pipeline: Pipeline, store: RunStore, tokenizer: Tokenizer | None = None,
        queue_limit: int = QUEUE_LIMIT, max_active: int = MAX_ACTIVE, prefill_chunk: int = PREFILL_CHUNK,
        identity: Identity | None = None, resume: bool = True,
    ) -> None:  # fmt: skip
        if queue_limit < 1:
            raise ValueError(f"queue_limit must be at least 1, got {queue_limit}")
        if max_active < 1:
            raise ValueError(f"max_active must be at least 1, got {max_active}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.pipeline = pipeline
        self.store = store
        self.tokenizer = tokenizer
        self.queue_limit = queue_limit
        self.max_active = max_active
        self.prefill_chunk = prefill_chunk
        self.bus = pipeline.bus
        self.scheduler = Scheduler(pipeline, lanes=min(LANES, len(pipeline.nodes)))
        self.latest: ClusterRun | None = None
        self._queue: deque[_Job] = deque()
        self._changed = asyncio.Event()  # a run was queued or one in flight ended
        self._active: dict[int, tuple[_Job, asyncio.Task]] = {}
        # Places in the queue taken by submits still storing their run: the limit counts them.
        self._reserved = 0
        self._finished: dict[int, asyncio.Future[ClusterRun]] = {}
        self._task: asyncio.Task | None = None
        layers = [node.layers for node in pipeline.nodes]
        self.identity = identity or Identity.of(pipeline.info.name, "", layers)
        self.resume = resume
        self.progress = Progress(store, self.running)
        self._resuming: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Take over (or mark interrupted) the runs coordinators now gone left unfinished, then execute."""
        if self.resume:
            taken, n = await self.store.take_over_unfinished(self.identity.why_not)
            await self._resume(taken)
            self.store.take_over_with(self.identity.why_not, self._taken)
        else:
            n = await self.store.interrupt_unfinished()
        if n:
            log.warning("%d run(s) left unfinished by a coordinator that is gone marked interrupted", n)
        self.latest = await self.store.latest()
        self.scheduler.start()
        self.progress.start()
        self._task = asyncio.create_task(self._loop())

    def _taken(self, runs: list[ClusterRun]) -> None:
        """Queue runs the store's sweep took over from a coordinator that went while this one runs."""
        task = asyncio.create_task(self._resume(runs))
        self._resuming.add(task)
        task.add_done_callback(self._resuming.discard)

    async def _resume(self, runs: list[ClusterRun]) -> None:
        """Queue again, in the order they were accepted, runs taken over from a coordinator that is gone."""
        for run in runs:
            req, ids = restore(run)
            try:
                await self.store.save(run)  # before it is queued: its start's save must come after
            except StoreError as exc:
                log.error("run %d taken over but not saved as queued: %s", run.id, exc)
            log.warning("run %d resumed from %d stored token(s)", run.id, len(run.tokens))
            self._enqueue(run, req, ids, None)

    @property
    def problem(self) -> str | None:
        """Why the run loop is not executing runs (it should never stop), or None while it runs."""
        if self._task is None:
            return "the run loop has not started"
        if not self._task.done():
            return self.scheduler.problem
        if self._task.cancelled():
            return "the run loop was stopped (the coordinator is shutting down)"
        return f"the run loop stopped: {self._task.exception()!r}; restart the coordinator"

    def check(self, req: RunRequest) -> None:
        """Refuse a request this model cannot run, saying why."""
        check(req, self.pipeline.info)

    def _refusal(self) -> Unavailable | None:
        """Why no run can be taken now, or None."""
        if (why := self.pipeline.unready()) is not None:
            return Unavailable(why)
        if (why := self.store.problem) is not None:
            return Unavailable(f"the run store cannot save runs now: {why}")
        if (why := self.problem) is not None:
            return Unavailable(why)
        if len(self._queue) + self._reserved >= self.queue_limit:
            return QueueFull(f"{self.queue_limit} runs are already waiting (the queue limit); retry later")
        return None

    async def submit(self, req: RunRequest, on_text: TextCallback | None = None) -> ClusterRun:
        """Store a queued run and put it in line; return its record.

        on_text: told each piece of a language model's text as it is generated.
        Raises ValueError for a request the model cannot take, Unavailable
        (QueueFull among them) when no run can be taken now.
        """
        self.check(req)
        if (refusal := self._refusal()) is not None:
            raise refusal
        # Taken before the first await, so concurrent submits cannot all pass the limit check.
        self._reserved += 1
        try:
            ids = await asyncio.to_thread(self._encode, req) if req.takes_text else []
            run = queued_run(req, ids, self.pipeline.info.name, self.identity.accepted(req, ids))
            try:
                await self.store.create(run)
            except StoreError as exc:
                raise Unavailable(f"the run store cannot save runs now: {exc}") from exc
        finally:
            self._reserved -= 1
        self._enqueue(run, req, ids, on_text)
        return run

    def _enqueue(self, run: ClusterRun, req: RunRequest, ids: list[int], on_text: TextCallback | None):
        """Put a stored queued run in line, and say so."""
        self._finished[run.id] = asyncio.get_running_loop().create_future()
        recorder = Recorder(run, self.bus, self.pipeline.recover_timeout)
        self._queue.append(_Job(run, req, ids, on_text, recorder))
        self._changed.set()
        self.bus.publish(RunQueued(run=run.id, model=run.model, queued=len(self._queue)))

    def _encode(self, req: RunRequest) -> list[int]:
        """The prompt's token ids (see coordinator.runs.requests.encode_prompt)."""
        assert self.tokenizer is not None
        return encode_prompt(req, self.tokenizer, self.pipeline.info)

    async def run(self, req: RunRequest, on_text: TextCallback | None = None) -> ClusterRun:
        """Submit a run and wait until it is finished and stored."""
        run = await self.submit(req, on_text)
        return await asyncio.shield(self._finished[run.id])

    def queued(self) -> int:
        """Runs waiting to start."""
        return len(self._queue)

    def live(self, run_id: int) -> ClusterRun | None:
        """The live record of run `run_id` while it is running, else None."""
        entry = self._active.get(run_id)
        return entry[0].run if entry is not None and entry[0].run.status == "running" else None

    def running(self) -> list[ClusterRun]:
        """The live records of the runs running now."""
        return [job.run for job, _ in self._active.values() if job.run.status == "running"]

    async def cancel(self, run_id: int) -> ClusterRun:
        """Cancel a queued or running run; return it as stored once it has ended.

        A queued run leaves the queue at once; a running one stops at the next
        forward boundary. Raises LookupError for a run that does not exist,
        RunFinishedError for one that has already finished, or that ended some
        other way before the cancel reached a boundary (it was past its last one):
        a run returned is always stored `cancelled`.
        """
        run = await self._cancelled(run_id)
        if run.status == "cancelled":
            return run
        # Said as a later cancel of the same run is: the answer agrees with the stored record.
        raise RunFinishedError(f"run {run_id} has already finished: it is {run.status}")

    async def _cancelled(self, run_id: int) -> ClusterRun:
        """Cancel run `run_id` if it has not ended; the run as stored once it has, however it ended."""
        for job in self._queue:
            if job.run.id == run_id:
                self._queue.remove(job)
                return await self._finish(job.run, "cancelled", "cancelled before it started")
        if (entry := self._active.get(run_id)) is not None:
            entry[0].recorder.cancelled = True
        if (ending := self._finished.get(run_id)) is not None:
            return await asyncio.shield(ending)
        run = await self.store.get(run_id)
        if run is None:
            raise LookupError(f"no run {run_id}")
        return run

    async def _loop(self) -> None:
        """Start queued runs in order while fewer than `max_active` are in flight."""
        while True:
            while not self._queue or len(self._active) >= self.max_active:
                self._changed.clear()
                await self._changed.wait()
            job = self._queue.popleft()
            task = asyncio.create_task(self._run(job))
            self._active[job.run.id] = (job, task)

    async def _run(self, job: _Job) -> None:
        """Execute one run and store how it ended; it leaves the runs in flight once stored."""
        try:
            try:
                await self.store.working()  # a run waits, queued, while the store cannot write
                status, error = await self._execute(job)
            except asyncio.CancelledError:
                started = job.run.status == "running"
                when = "during the run" if started else "before the run started"
                await self._finish(job.run, "interrupted", f"the coordinator stopped {when}")
                raise
            except Exception as exc:  # a bug must fail the run, never the runner
                log.exception("run %d failed", job.run.id)
                status, error = "failed", f"{type(exc).__name__}: {exc}"
            await self._finish(job.run, status, error)
        finally:
            self._active.pop(job.run.id, None)
            self._changed.set()

    async def _execute(self, job: _Job) -> tuple[RunStatus, str | None]:
        """Run `job` on the pipeline; return how it ended."""
        run, req, recorder = job.run, job.req, job.recorder
        if recorder.cancelled:  # while it waited for the store to work
            return "cancelled", "cancelled before it started"
        session = f"run-{run.id}"
        run.status = "running"
        self.latest = run
        try:
            await self.store.save(run)
        except StoreError as exc:
            log.error("run %d not started: %s", run.id, exc)
            return "failed", "not run: the run store could not record its start"
        self.bus.publish(RunStarted(run=run.id))
        recorder.start()
        status, error = "ok", None
        try:
            with self.scheduler.member():
                if job.prompt_ids:
                    sampling = Sampling(
                        req.max_new_tokens, req.temperature, req.top_k, req.seed, req.top_p, tuple(req.stop)
                    )
                    await generate(
                        self.scheduler, self.tokenizer, run, job.prompt_ids, sampling, session, recorder,
                        job.on_text, self.prefill_chunk,
                    )  # fmt: skip
                else:
                    await forward_once(self.scheduler, run, req.seed, session, recorder)
        except RunCancelled as exc:
            status, error = "cancelled", str(exc)
        except StageFailed as exc:
            status, error = "failed", str(exc)
        except Exception as exc:  # a bug must fail the run, not the coordinator
            log.exception("run %d failed", run.id)
            status, error = "failed", f"{type(exc).__name__}: {exc}"
        with suppress(Exception):
            await self.pipeline.reset(session)
        return status, error

    async def _finish(self, run: ClusterRun, status: RunStatus, error: str | None) -> ClusterRun:
        """Store how `run` ended, then tell whoever waits and the bus; a failing store keeps it for later."""
        final = msgspec.structs.replace(run, status=status, error=error, finished_at=time.time())
        try:
            await self.store.save(final)
        except StoreUnavailable as exc:
            ended = f"{status}: {error}" if error else status
            why = f"the run store could not save the run's end ({exc}); the run itself ended {ended}"
            final = msgspec.structs.replace(final, status="failed", error=why)
            self.store.save_later(final)
        except StoreError as exc:  # e.g. its row was removed by hand: nothing to retry
            log.error("run %d could not be saved: %s", run.id, exc)
        self.latest = final if self.latest is run else self.latest
        if final.error:
            log.error("run %d %s: %s", run.id, final.status, final.error)
        fut = self._finished.pop(run.id, None)
        if fut is not None and not fut.done():
            fut.set_result(final)
        self._tell_finished(final)
        return final

    def _tell_finished(self, run: ClusterRun) -> None:
        """Publish how a stored run ended, with its forward time and token counts."""
        decode_ms = run.decode.total_forward_ms if run.decode is not None else 0.0
        self.bus.publish(
            RunFinished(
                run=run.id, status=run.status, error=run.error, total_ms=run.total_forward_ms + decode_ms,
                prompt_tokens=run.seq if run.prompt is not None else 0, generated_tokens=len(run.tokens),
            )
        )  # fmt: skip

    async def close(self) -> None:
        """Stop executing: the runs in progress are stored as interrupted, queued ones too."""
        for resuming in self._resuming:
            resuming.cancel()
        await self.progress.close()
        tasks = {task for _, task in self._active.values()}
        if self._task is not None:
            tasks.add(self._task)
        for task in tasks:
            task.cancel()
        if tasks:
            # Time for the runs in progress to store their end, which may wait out the store's busy timeout.
            await asyncio.wait(tasks, timeout=CLOSE_GRACE_S)
        while undone := {task for task in tasks if not task.done()}:  # cancel again if one was swallowed
            for task in undone:
                task.cancel()
            await asyncio.wait(undone, timeout=1.0)
        if self._task is not None and (why := self.problem) is not None and not self._task.cancelled():
            log.error("%s", why)  # said, not raised: shutting down goes on
        for job, _ in list(self._active.values()):  # cancelled before its task began
            await self._finish(job.run, "interrupted", "the coordinator stopped before the run started")
        await self.scheduler.close()
        while self._queue:
            job = self._queue.popleft()
            await self._finish(job.run, "interrupted", "the coordinator stopped before the run started")
