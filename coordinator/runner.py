"""Execute queued runs one at a time on the live pipeline and keep their records.

A run is stored when it is queued, saved when it starts, and committed with
its final status before anyone is told it finished. While it runs, the live
record (stages finished so far) is `Runner.latest`. A request the model cannot
take (a prompt for a model fed activations, a prompt that encodes to nothing or
fills the context, an activation over MAX_ACTIVATION) is refused when
submitted, with a ValueError saying why. A run that cannot go through now (a
stage not up, a failing store, a full queue) is refused with Unavailable.

The run loop outlives a failing store: a run whose save fails ends `failed`
(its record kept by the store and written when it works again), and the next
run starts only once the store works.

Each run is told to the cluster's event bus: queued when submitted, started,
and finished once its end is stored. A run can be cancelled: a queued one
leaves the queue, a running one stops at the next forward boundary (see
coordinator.recorder); either is stored `cancelled` and its session dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from coordinator.errors import Unavailable
from coordinator.events import RunFinished, RunQueued, RunStarted
from coordinator.generation import Sampling, TextCallback, generate
from coordinator.pipeline import Pipeline, StageFailed
from coordinator.recorder import Recorder, RunCancelled
from coordinator.stats import ClusterRun, RunStatus
from coordinator.store import RunStore, StoreError, StoreUnavailable, bound_output
from workers.models.synthetic import make_input

if TYPE_CHECKING:
    from workers.models.tokenizer import Tokenizer

log = logging.getLogger("coordinator.runner")

DEFAULT_SEQ = 16
# Runs waiting to start; one more is refused with 503 (QueueFull).
QUEUE_LIMIT = 1000
# Positions in a synthetic run's input (`seq`); more is a 400.
MAX_SEQ = 65_536
# Floats in one activation, positions × hidden (16 MiB as float32); more is a 400.
MAX_ACTIVATION = 1 << 22
# Characters in a prompt, or in a chat's messages together; more is a 400 (the HTTP body limit is
# sized so any such prompt fits).
MAX_PROMPT_CHARS = 100_000
# Seconds close() lets the run in progress store its end before cancelling again.
CLOSE_GRACE_S = 10.0
# Tokens a run may generate.
MAX_NEW_TOKENS = 4096
# Stop strings a run may have, and characters in each.
MAX_STOPS, MAX_STOP_CHARS = 16, 1000
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]


class ChatTurn(msgspec.Struct, forbid_unknown_fields=True):
    """One message of a chat: who says it (system, user or assistant) and what."""

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)]


class RunRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What to run: `seq`/`seed` for a model fed activations, `prompt` or `messages` for a language model.

    seq: positions in the synthetic input (default 16).
    seed: seeds the synthetic input, or sampling.
    prompt: text to continue (language models).
    max_new_tokens: tokens to generate at most.
    temperature: 0 is greedy; above 0 samples.
    top_k: sample among the k most likely tokens (0 = all).
    chat: wrap the prompt as a user turn in the model's chat template.
    messages: a conversation to continue through the chat template, instead of a prompt.
    top_p: sample among the most likely tokens whose probabilities reach top_p (1 = all).
    stop: strings that end the text; it ends before the first one generated.
    """

    seq: Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQ)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = 0
    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = None
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)] = 32
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.0
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    chat: bool = False
    messages: Annotated[list[ChatTurn], msgspec.Meta(min_length=1)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    stop: Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOPS)] = []


def _check_messages(req: RunRequest) -> None:
    """Refuse a chat that also has a prompt, or whose messages are longer than a prompt may be."""
    assert req.messages is not None
    if req.prompt is not None or req.chat:
        raise ValueError("send a prompt or messages, not both (messages always go through the chat template)")
    chars = sum(len(turn.content) for turn in req.messages)
    if chars > MAX_PROMPT_CHARS:
        limit = MAX_PROMPT_CHARS
        raise ValueError(f"the messages hold {chars:,} characters together, over the limit of {limit:,}")


def _transcript(messages: list[ChatTurn]) -> str:
    """A chat as a run record's prompt: one `role: content` line per message."""
    return "\n".join(f"{turn.role}: {turn.content}" for turn in messages)


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
    """Owns the run queue; executes runs in order on one pipeline and tells the pipeline's bus about them."""

    def __init__(
        self, pipeline: Pipeline, store: RunStore, tokenizer: Tokenizer | None = None,
        queue_limit: int = QUEUE_LIMIT,
    ) -> None:  # fmt: skip
        if queue_limit < 1:
            raise ValueError(f"queue_limit must be at least 1, got {queue_limit}")
        self.pipeline = pipeline
        self.store = store
        self.tokenizer = tokenizer
        self.queue_limit = queue_limit
        self.bus = pipeline.bus
        self.latest: ClusterRun | None = None
        self._queue: deque[_Job] = deque()
        self._queued = asyncio.Event()
        self._current: _Job | None = None
        # Places in the queue taken by submits still storing their run: the limit counts them.
        self._reserved = 0
        self._finished: dict[int, asyncio.Future[ClusterRun]] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Mark runs a previous coordinator left unfinished, then start executing."""
        n = await self.store.interrupt_unfinished()
        if n:
            log.warning("%d run(s) left unfinished by a previous coordinator marked interrupted", n)
        self.latest = await self.store.latest()
        self._task = asyncio.create_task(self._loop())

    @property
    def problem(self) -> str | None:
        """Why the run loop is not executing runs (it should never stop), or None while it runs."""
        if self._task is None:
            return "the run loop has not started"
        if not self._task.done():
            return None
        if self._task.cancelled():
            return "the run loop was stopped (the coordinator is shutting down)"
        return f"the run loop stopped: {self._task.exception()!r}; restart the coordinator"

    def check(self, req: RunRequest) -> None:
        """Refuse a request this model cannot run, saying why."""
        name = self.pipeline.info.name
        if self.pipeline.info.input == "tokens":
            if req.prompt is None and req.messages is None:
                send = '{"prompt": "..."} or {"messages": [...]}'
                raise ValueError(f"model {name!r} takes a prompt: send {send}")
            if req.seq is not None:
                raise ValueError("seq is for models fed activations; this one takes a prompt")
            if req.messages is not None:
                _check_messages(req)
        elif req.prompt is not None or req.messages is not None:
            raise ValueError(f'model {name!r} takes no prompt: send {{"seq": N, "seed": S}}')
        else:
            self._check_activation(req.seq or DEFAULT_SEQ, "seq")

    def _check_activation(self, positions: int, what: str) -> None:
        """Refuse a forward whose activation, positions × hidden, is over MAX_ACTIVATION floats."""
        hidden = self.pipeline.info.hidden
        if positions * hidden > MAX_ACTIVATION:
            raise ValueError(
                f"{what} {positions} × hidden {hidden} = {positions * hidden:,} floats per activation, "
                f"over the limit of {MAX_ACTIVATION:,} (MAX_ACTIVATION): this model takes {what} up to "
                f"{MAX_ACTIVATION // hidden:,}"
            )

    def _encode_prompt(self, req: RunRequest) -> list[int]:
        """The prompt's token ids as the model will see them; a ValueError when it cannot take them."""
        assert self.tokenizer is not None
        # chat() and chat_turns() are a ValueError for a model without a chat template.
        if req.messages is not None:
            text = self.tokenizer.chat_turns([(turn.role, turn.content) for turn in req.messages])
        else:
            assert req.prompt is not None
            text = self.tokenizer.chat(req.prompt) if req.chat else req.prompt
        try:
            text.encode()
        except UnicodeEncodeError as exc:  # a lone surrogate, e.g. from undecodable command-line bytes
            where = f"{exc.reason} at character {exc.start}"
            raise ValueError(f"the prompt is not valid Unicode text: {where}") from None
        ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError("the prompt encodes to no tokens: none of its characters is in the vocabulary")
        context = self.pipeline.info.context_length
        if len(ids) >= context:
            raise ValueError(
                f"the prompt is {len(ids)} tokens; the model's context holds {context}, "
                "so no room is left to generate: shorten the prompt"
            )
        self._check_activation(len(ids), "prompt tokens")
        return ids

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
            takes_text = req.prompt is not None or req.messages is not None
            ids = await asyncio.to_thread(self._encode_prompt, req) if takes_text else []
            run = ClusterRun(
                timings=[],
                total_forward_ms=0.0,
                output=[],
                status="queued",
                model=self.pipeline.info.name,
                created_at=time.time(),
                seq=len(ids) or req.seq or DEFAULT_SEQ,
                prompt=req.prompt if req.messages is None else _transcript(req.messages),
            )
            try:
                await self.store.create(run)
            except StoreError as exc:
                raise Unavailable(f"the run store cannot save runs now: {exc}") from exc
        finally:
            self._reserved -= 1
        self._finished[run.id] = asyncio.get_running_loop().create_future()
        self._queue.append(_Job(run, req, ids, on_text, Recorder(run, self.bus)))
        self._queued.set()
        self.bus.publish(RunQueued(run=run.id, model=run.model, queued=len(self._queue)))
        return run

    async def run(self, req: RunRequest, on_text: TextCallback | None = None) -> ClusterRun:
        """Submit a run and wait until it is finished and stored."""
        run = await self.submit(req, on_text)
        return await asyncio.shield(self._finished[run.id])

    def queued(self) -> int:
        """Runs waiting to start."""
        return len(self._queue)

    async def cancel(self, run_id: int) -> ClusterRun:
        """Cancel a queued or running run; return it as stored once it has ended.

        A queued run leaves the queue at once; a running one stops at the next
        forward boundary. Raises LookupError for a run that does not exist,
        RunFinishedError for one that has already finished.
        """
        for job in self._queue:
            if job.run.id == run_id:
                self._queue.remove(job)
                return await self._finish(job.run, "cancelled", "cancelled before it started")
        if self._current is not None and self._current.run.id == run_id:
            self._current.recorder.cancelled = True
        if (ending := self._finished.get(run_id)) is not None:
            return await asyncio.shield(ending)
        run = await self.store.get(run_id)
        if run is None:
            raise LookupError(f"no run {run_id}")
        raise RunFinishedError(f"run {run_id} has already finished: it is {run.status}")

    async def _next(self) -> _Job:
        """The next queued run, once there is one."""
        while not self._queue:
            self._queued.clear()
            await self._queued.wait()
        return self._queue.popleft()

    async def _loop(self) -> None:
        while True:
            job = self._current = await self._next()
            try:
                await self.store.working()  # a run waits, queued, while the store cannot write
                status, error = await self._execute(job)
            except asyncio.CancelledError:
                started = job.run.status == "running"
                when = "during the run" if started else "before the run started"
                await self._finish(job.run, "interrupted", f"the coordinator stopped {when}")
                raise
            except Exception as exc:  # a bug must fail the run, never stop the loop
                log.exception("run %d failed", job.run.id)
                status, error = "failed", f"{type(exc).__name__}: {exc}"
            await self._finish(job.run, status, error)
            self._current = None

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
            if job.prompt_ids:
                sampling = Sampling(
                    req.max_new_tokens, req.temperature, req.top_k, req.seed, req.top_p, tuple(req.stop)
                )
                tokenizer = self.tokenizer
                await generate(
                    self.pipeline, tokenizer, run, job.prompt_ids, sampling, session, recorder, job.on_text
                )
            else:
                await self._forward_once(run, req, session, recorder)
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

    async def _forward_once(self, run: ClusterRun, req: RunRequest, session: str, recorder: Recorder) -> None:
        info = self.pipeline.info
        x = make_input(run.seq, info.hidden, req.seed)
        started = time.monotonic()
        on_stage = recorder.begin(0, run.seq, run.timings.append)
        y = await self.pipeline.forward(x, session=session, start_pos=0, on_stage=on_stage)
        run.total_forward_ms = (time.monotonic() - started) * 1000
        # Off the event loop: a big output's list and digest take a while.
        run.output, run.output_shape, run.output_digest, run.output_omitted = await asyncio.to_thread(
            bound_output, y
        )
        recorder.end()

    async def close(self) -> None:
        """Stop executing: the run in progress is stored as interrupted, queued ones too."""
        if self._task is not None:
            self._task.cancel()
            # Time for the run in progress to store its end, which may wait out the store's busy timeout.
            await asyncio.wait({self._task}, timeout=CLOSE_GRACE_S)
            while not self._task.done():  # cancel again if a cancellation was swallowed
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=1.0)
            if (why := self.problem) is not None and not self._task.cancelled():
                log.error("%s", why)  # said, not raised: shutting down goes on
        while self._queue:
            job = self._queue.popleft()
            await self._finish(job.run, "interrupted", "the coordinator stopped before the run started")
