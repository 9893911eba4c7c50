"""Execute queued runs one at a time on the live pipeline and keep their records.

A run is stored when it is queued, saved when it starts, and committed with
its final status before anyone is told it finished. While it runs, the live
record (stages finished so far) is `Runner.latest`. A request the model cannot
take (a prompt for a model fed activations, a prompt that encodes to nothing or
fills the context) is refused when submitted, with a ValueError saying why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import msgspec

from coordinator.generation import Sampling, TextCallback, generate
from coordinator.pipeline import Pipeline, StageFailed
from coordinator.stats import ClusterRun, RunStatus
from coordinator.store import RunStore
from workers.models.synthetic import make_input

if TYPE_CHECKING:
    from workers.models.tokenizer import Tokenizer

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


@dataclass
class _Job:
    """A queued run and what executing it needs.

    prompt_ids: a language model's prompt as token ids, encoded when submitted.
    on_text: told each piece of generated text as it is decoded.
    """

    run: ClusterRun
    req: RunRequest
    prompt_ids: list[int]
    on_text: TextCallback | None


class Runner:
    """Owns the run queue; executes runs in order on one pipeline."""

    def __init__(self, pipeline: Pipeline, store: RunStore, tokenizer: Tokenizer | None = None) -> None:
        self.pipeline = pipeline
        self.store = store
        self.tokenizer = tokenizer
        self.latest: ClusterRun | None = None
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
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
                name = self.pipeline.info.name
                raise ValueError(f"model {name!r} takes a prompt: send {{\"prompt\": \"...\"}}")
            if req.seq is not None:
                raise ValueError("seq is for models fed activations; this one takes a prompt")
        elif req.prompt is not None:
            name = self.pipeline.info.name
            raise ValueError(f"model {name!r} takes no prompt: send {{\"seq\": N, \"seed\": S}}")

    def _encode_prompt(self, req: RunRequest) -> list[int]:
        """The prompt's token ids as the model will see them; a ValueError when it cannot take them."""
        assert self.tokenizer is not None and req.prompt is not None
        # chat() is a ValueError for a model without a chat template.
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
        return ids

    async def submit(self, req: RunRequest, on_text: TextCallback | None = None) -> ClusterRun:
        """Store a queued run and put it in line; return its record.

        on_text: told each piece of a language model's text as it is generated.
        """
        self.check(req)
        if self._queue.qsize() >= QUEUE_LIMIT:
            raise QueueFull(f"{QUEUE_LIMIT} runs are already waiting")
        ids = await asyncio.to_thread(self._encode_prompt, req) if req.prompt is not None else []
        run = ClusterRun(
            timings=[],
            total_forward_ms=0.0,
            output=[],
            status="queued",
            model=self.pipeline.info.name,
            created_at=time.time(),
            seq=len(ids) or req.seq or DEFAULT_SEQ,
            prompt=req.prompt,
        )
        await self.store.create(run)
        self._finished[run.id] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Job(run, req, ids, on_text))
        return run

    async def run(self, req: RunRequest, on_text: TextCallback | None = None) -> ClusterRun:
        """Submit a run and wait until it is finished and stored."""
        run = await self.submit(req, on_text)
        return await asyncio.shield(self._finished[run.id])

    def queued(self) -> int:
        """Runs waiting to start."""
        return self._queue.qsize()

    async def _loop(self) -> None:
        while True:
            await self._execute(await self._queue.get())

    async def _execute(self, job: _Job) -> None:
        run, req = job.run, job.req
        session = f"run-{run.id}"
        run.status = "running"
        self.latest = run
        await self.store.save(run)
        status, error = "ok", None
        try:
            if job.prompt_ids:
                sampling = Sampling(req.max_new_tokens, req.temperature, req.top_k, req.seed)
                tokenizer = self.tokenizer
                await generate(self.pipeline, tokenizer, run, job.prompt_ids, sampling, session, job.on_text)
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

    async def _finish(self, run: ClusterRun, status: RunStatus, error: str | None) -> None:
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

    async def close(self) -> None:
        """Stop executing: the run in progress is stored as interrupted, queued ones too."""
        if self._task is not None:
            while not self._task.done():  # cancel again if a cancellation was swallowed
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=1.0)
            with suppress(asyncio.CancelledError):
                await self._task
        while not self._queue.empty():
            job = self._queue.get_nowait()
            await self._finish(job.run, "interrupted", "the coordinator stopped before the run started")
