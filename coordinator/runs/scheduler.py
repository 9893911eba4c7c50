"""Send the forwards of the runs in flight through the pipeline: prompts alone, decode steps batched.

A run that executes is a member while it forwards. The one-position decode
steps of the members go together as batched forwards (Pipeline.forward_batch),
so that each stage's matmuls see one row per run while each run keeps its own
session, positions and KV cache. Up to `lanes` batches are in flight at once,
so that while one batch is at a stage another can be at the next (as
micro-batches fill a pipeline): a batch is sent when a lane is free and no
member is between steps (sampling its next token) unless it is in flight, and
takes at most its share of the decoding runs (their count over the lanes), so
that the lanes settle into groups of even size. A prompt (several positions)
goes by itself, up to `lanes` prompts in flight at once (one can be at a stage
while another is at the next), while the decode steps of the others go on; a
long prompt comes as chunks one after another (coordinator.runs.generation),
so at a stage the others wait for a chunk at most, never for the whole prompt.
Each stage still serves one request at a time, in order.

A run of a batch fails alone where it can. A cancel (raised by the run's stage
hook, told each stage's timing of the batch as it replies) takes that run out
and the others get their rows. When a stage refuses the batch (an error from the
worker, every stage still up), each of its runs is sent again by itself, so
only the runs whose own forward is refused fail: a llama stage checks every
session of a batch before changing any, so the others go on where they were
(a refusal at a later stage, after earlier ones advanced every session, fails
them all). A stage that died or hung fails every run of the batch, naming the
stage, as Pipeline.forward does.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from coordinator.stages.chain import ForwardRequest
from coordinator.stages.pipeline import Pipeline, StageFailed
from coordinator.stats import Recovery, StageTiming
from workers.protocol.info import ModelInfo

log = logging.getLogger("coordinator.runs.scheduler")

# Decode batches, and prompts, in flight at once (no more than the stages): two keep two stages busy at
# a time. 4 chats through 3 packed workers: 2.0x the tokens/s of one at a time, with one prompt in
# flight at a time 1.6x (bench/concurrency.py).
LANES = 2


@dataclass(eq=False)
class _Waiting:
    """A member's forward waiting to be sent, and where its output goes."""

    request: ForwardRequest
    done: asyncio.Future[np.ndarray]

    @property
    def rows(self) -> int:
        """Positions the forward computes: a prompt's several, a decode step's one."""
        return len(self.request.item.x)

    def settle(self, output: np.ndarray | None = None, error: BaseException | None = None) -> None:
        """Hand the member its output or error, unless it stopped waiting (cancelled)."""
        if self.done.done():
            return
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result(output)


class Scheduler:
    """Gathers the forwards of the runs in flight and sends them through one pipeline, batched.

    lanes: decode batches, and prompts, in flight at once (1: every decoding run in one batch and one
    prompt at a time, one stage busy with each).
    """

    def __init__(self, pipeline: Pipeline, lanes: int = 1) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be at least 1, got {lanes}")
        self.pipeline = pipeline
        self.lanes = lanes
        # Forwards sent as a batch of several runs, and the rows in them (how much batching happened).
        self.batches = self.batched_rows = 0
        self._members = 0
        self._waiting: list[_Waiting] = []
        self._sent = 0  # members' forwards in flight
        self._prompts: set[asyncio.Task] = set()  # the prompts in flight
        self._decode: dict[asyncio.Task, int] = {}  # decode batches in flight, and their rows
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def info(self) -> ModelInfo:
        """The model the pipeline runs."""
        return self.pipeline.info

    @property
    def problem(self) -> str | None:
        """Why forwards are not being sent (the loop stopped), or None while it runs."""
        if self._task is None or not self._task.done():
            return None
        if self._task.cancelled():
            return "the forward scheduler was stopped (the coordinator is shutting down)"
        return f"the forward scheduler stopped: {self._task.exception()!r}; restart the coordinator"

    def start(self) -> None:
        """Start sending forwards."""
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        """Stop sending forwards; members still waiting are told the scheduler stopped."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=1.0)

    @contextmanager
    def member(self) -> Iterator[None]:
        """Count the caller as a run in flight: batches wait for its next forward while it is in between."""
        self._members += 1
        try:
            yield
        finally:
            self._members -= 1
            self._changed.set()

    async def forward(self, request: ForwardRequest) -> np.ndarray:
        """Send the request through every stage once every member waits; batched with theirs if a decode step.

        Its halt stops a forward sent alone before a stage (Pipeline.forward); a batch goes on, and a
        cancelled member leaves it through its hook.
        """
        waiting = _Waiting(request, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        self._changed.set()
        try:
            return await waiting.done
        finally:
            if waiting in self._waiting:  # cancelled before it was sent
                self._waiting.remove(waiting)
                self._changed.set()

    async def _loop(self) -> None:
        try:
            while True:
                self._send_ready()
                self._changed.clear()
                await self._changed.wait()
        finally:
            for task in [*self._prompts, *self._decode]:
                task.cancel()
            stopped = RuntimeError("the forward scheduler stopped")
            for w in self._waiting:
                w.settle(error=stopped)

    def _send_ready(self) -> None:
        """Send waiting prompts on free lanes, in order; decode steps on a free lane once none is between."""
        prompts = [w for w in self._waiting if w.rows > 1]
        for prompt in prompts[: max(0, self.lanes - len(self._prompts))]:
            self._prompts.add(self._send([prompt]))
        steps = [w for w in self._waiting if w.rows == 1]
        between = self._members - len(self._waiting) - self._sent
        if between > 0:
            return
        decoding = len(steps) + sum(self._decode.values())
        share = -(-decoding // self.lanes)  # each lane's even share of the decoding runs, rounded up
        while steps and len(self._decode) < self.lanes:
            group, steps = steps[:share], steps[share:]
            self._decode[self._send(group)] = len(group)

    def _send(self, group: list[_Waiting]) -> asyncio.Task:
        """Send `group` as one forward (a batch when several) on a task of its own."""
        for w in group:
            self._waiting.remove(w)
        self._sent += len(group)
        task = asyncio.create_task(self._alone(group[0]) if len(group) == 1 else self._batch(group))
        task.add_done_callback(functools.partial(self._sent_back, group))
        return task

    def _sent_back(self, group: list[_Waiting], task: asyncio.Task) -> None:
        """A forward came back: its members are between steps again."""
        self._sent -= len(group)
        self._prompts.discard(task)
        self._decode.pop(task, None)
        if not task.cancelled() and (exc := task.exception()) is not None:  # a bug must fail these runs only
            log.error("forward of %d run(s) failed", len(group), exc_info=exc)
            for w in group:
                w.settle(error=exc)
        self._changed.set()

    async def _alone(self, w: _Waiting) -> None:
        """Send one member's forward by itself, its stages timed as they reply."""
        try:
            y = await self.pipeline.forward(w.request)
        except Exception as exc:
            w.settle(error=exc)
        else:
            w.settle(y)

    async def _batch(self, group: list[_Waiting]) -> None:
        """Send several members' decode steps as one forward; fail only the runs that must."""
        left: dict[int, Exception] = {}  # runs that left the batch (cancelled), by place in it

        def tell(t: StageTiming) -> None:
            for i, w in enumerate(group):
                if i not in left:
                    try:
                        w.request.on_stage(t)
                    except Exception as exc:  # the run was cancelled: it leaves, the others go on
                        left[i] = exc

        def halt() -> None:  # on the forward thread, and while the batch waits for a lost stage
            for i, w in enumerate(group):
                if i not in left:
                    try:
                        w.request.halt()
                    except Exception as exc:  # cancelled: it leaves as the batch comes back
                        left[i] = exc
            if len(left) == len(group):  # nobody is left to wait for
                raise next(iter(left.values()))

        def recovery(session: str, r: Recovery, reason: str | None) -> None:
            for w in group:
                if w.request.item.session == session:
                    w.request.on_recovery(session, r, reason)

        items = [w.request.item for w in group]
        try:
            outputs, _ = await self.pipeline.forward_batch(items, tell, halt, recovery)
        except StageFailed as exc:
            if self.pipeline.unready() is not None:  # a stage is gone: every run of the batch goes with it
                for w in group:
                    w.settle(error=exc)
                return
            log.warning("a stage refused a batch of %d runs (%s); sending each alone", len(group), exc)
            for w in group:
                await self._alone(w)
            return
        except Exception:
            if len(left) < len(group):
                raise
            for i, w in enumerate(group):  # every run of the batch was cancelled
                w.settle(error=left[i])
            return
        self.batches += 1
        self.batched_rows += len(group)
        for i, (w, y) in enumerate(zip(group, outputs, strict=True)):
            if i in left:
                w.settle(error=left[i])
            else:
                w.settle(y)
