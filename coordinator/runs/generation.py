"""Generate text through the pipeline: the prefill and every decode step are the same step.

A step forwards some tokens at the next positions, samples the next token from
the last position's logits, and stops at an end token (EOS, or another the
model's file marks as ending a turn: Tokenizer.end_ids) or once
the text holds a stop string (the text then ends before it); the run's
`finish_reason` says which ended it, or that the budget did. The prompt
is the first step's input (timed into the run itself), each generated token
the next one's (timed into the run's `decode` record); per-stage times are
summed over a record's forwards.

A step of more than PREFILL_CHUNK positions (a long prompt) is forwarded a
chunk at a time, each extending the session's KV cache on every stage where the
last one ended, so that no forward takes longer than a chunk does, whatever
the prompt: a stage's time grows with the positions it is sent, and one forward
of a whole long prompt can outlast the forward timeout, which drops the stage.
Between chunks the run's cancel is read, and other runs' forwards reach the
stages. Every forward is also recorded one by one (see
coordinator.runs.recorder), which is where a cancelled run stops. A run
without a prompt (a model fed activations) is one forward instead
(`forward_once`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec
import numpy as np

from coordinator.runs.recorder import Recorder, RunCancelled
from coordinator.stages.chain import ForwardRequest
from coordinator.stats import ClusterRun, StageTiming
from coordinator.store.rows import bound_output
from workers.models import model_input
from workers.models.generate import sample
from workers.protocol.info import BatchItem, ModelInfo

if TYPE_CHECKING:
    from workers.models.tokenizer import Tokenizer

TextCallback = Callable[[str], None]

# Positions forwarded at once at most: a longer prompt goes in chunks of as even a size as can be.
# 512 is llama.cpp's micro-batch (n_ubatch), and the rows up to which a packed stage multiplies on its
# blocks (workers.models.kernels.KERNEL_MAX_ROWS): every chunk is computed as a short prompt is, and
# there a prompt's logits do not depend on how it is cut (bitwise; f32's to rounding). A chunk's time
# grows with the cache it attends to: a 7,241-token SmolLM2 prompt through one worker took 3-20 s of
# CPU a chunk, 165-180 s in all (196 s in one forward, which outlasts the 60 s forward timeout);
# chunks of 1,024 took up to 38 s, for as much in all.
PREFILL_CHUNK = 512


class Forwarder(Protocol):
    """What sends a step through the stages: the pipeline itself, or the scheduler that batches steps."""

    @property
    def info(self) -> ModelInfo: ...

    async def forward(self, request: ForwardRequest) -> np.ndarray: ...


@dataclass(frozen=True)
class Sampling:
    """How to choose tokens: greedy at temperature 0, else top_k then top_p softmax seeded by `seed`.

    stop: strings that end the generation; the text ends before the first one.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()


async def generate(
    pipeline: Forwarder,
    tokenizer: Tokenizer,
    run: ClusterRun,
    prompt_ids: list[int],
    sampling: Sampling,
    session: str,
    recorder: Recorder,
    on_text: TextCallback | None = None,
    chunk: int = PREFILL_CHUNK,
) -> None:
    """Continue `prompt_ids` into `run` until an end token, a stop string, the budget or a full context.

    `run.finish_reason` says which: "stop" for an end token or a stop string.

    chunk: positions forwarded at once at most (PREFILL_CHUNK).
    """
    budget = min(sampling.max_new_tokens, pipeline.info.context_length - len(prompt_ids))
    gen = Generation(pipeline, tokenizer, run, sampling, session, recorder, on_text, chunk)
    # A resumed run goes on from the tokens it had stored: one prefill of the prompt and them.
    done = gen.replay(budget)
    try:
        token = None if done else await gen.step([*prompt_ids, *run.tokens])
        if token is not None:
            gen.start_decode()
        while token is not None and len(run.tokens) < budget:
            token = await gen.step([token])
    except RunCancelled:
        run.finish_reason = "cancelled"
        raise
    if token is not None:  # no end token, no stop string: the budget or the context is spent
        run.finish_reason = "length"
    gen.finish()


async def forward_once(
    forwarder: Forwarder, run: ClusterRun, seed: int, session: str, recorder: Recorder
) -> None:
    """A run without a prompt: one forward of `run.seq` positions of seeded activations, timed into the
    run, its output kept as the store bounds it."""
    x = model_input(forwarder.info, run.seq, seed)
    started = time.monotonic()
    on_stage = recorder.begin(0, run.seq, run.timings.append)
    y = await forwarder.forward(
        ForwardRequest(BatchItem(x, session, 0), on_stage, recorder.check, recorder.recovery)
    )
    run.total_forward_ms = (time.monotonic() - started) * 1000
    # Off the event loop: a big output's list and digest take a while.
    run.output, run.output_shape, run.output_digest, run.output_omitted = await asyncio.to_thread(
        bound_output, y
    )
    recorder.end()


class Generation:
    """One generation run between steps: its position, its sampler, the record being timed."""

    def __init__(
        self,
        pipeline: Forwarder,
        tokenizer: Tokenizer,
        run: ClusterRun,
        sampling: Sampling,
        session: str,
        recorder: Recorder,
        on_text: TextCallback | None,
        chunk: int = PREFILL_CHUNK,
    ) -> None:
        self.pipeline, self.tokenizer, self.run, self.sampling = pipeline, tokenizer, run, sampling
        self.session, self.recorder, self.on_text, self.chunk = session, recorder, on_text, chunk
        self.stream = tokenizer.stream()
        self.pos = 0
        self.steps = 0  # 0 while the prompt is forwarded (every chunk of it), n for the n-th decode step
        self.stopped = False  # by a stop string
        self.phase, self.phase_pos, self.phase_started = run, 0, time.monotonic()
        self.on_stage: Callable[[StageTiming], None] = functools.partial(_accumulate, run.timings)
        run.text = ""

    def replay(self, budget: int) -> bool:
        """Rebuild the text of the tokens a resumed run had stored; whether they end it already."""
        for token in self.run.tokens:
            self.run.text += self.stream.push(token)
        if self.run.tokens and self._stop_string(0):
            return True
        if len(self.run.tokens) >= budget:
            self.run.finish_reason = "length"
            return True
        return False

    def start_decode(self) -> None:
        """Time the following steps into a new decode record of the run."""
        decode = ClusterRun(timings=[], total_forward_ms=0.0, output=[], status="running", seq=0)
        self.run.decode = self.phase = decode
        self.phase_pos, self.phase_started = self.pos, time.monotonic()
        self.on_stage = functools.partial(_accumulate, decode.timings)

    async def step(self, x: list[int]) -> int | None:
        """Forward `x` at the next positions and sample: the next token, or None at an end token."""
        logits = await self._forward(np.asarray(x, np.int32))
        self.steps += 1
        self.pos += len(x)
        self.phase.seq = self.pos - self.phase_pos
        self.phase.total_forward_ms = (time.monotonic() - self.phase_started) * 1000
        sampling = self.sampling
        # Greedy draws nothing: a generator per step would cost more than its argmax (~50 us).
        rng = draws(sampling.seed, self.pos) if sampling.temperature > 0 else None
        token = sample(logits[-1], sampling.temperature, sampling.top_k, rng, sampling.top_p)
        self.recorder.end()
        if token in self.tokenizer.end_ids:  # EOS, or any other token the file marks as an end
            self.run.finish_reason = "stop"
            return None
        self.run.tokens.append(token)
        piece = self.stream.push(token)
        self.recorder.token(len(self.run.tokens) - 1, token, piece)
        before = len(self.run.text)
        self._emit(piece)
        return None if self._stop_string(before) else token

    async def _forward(self, ids: np.ndarray) -> np.ndarray:
        """Forward `ids` at the next positions, a chunk at a time; the last position's logits.

        Each chunk is a forward of its own in the record; a cancel stops the step before the next
        one (Recorder.begin), or before the next stage. Only the last position's logits are read,
        so every chunk asks for the last row alone (last_only): the fewest the last stage returns.
        """
        logits = np.empty(0, np.float32)
        for a, b in spans(len(ids), self.chunk):
            on_stage = self.recorder.begin(self.steps, b - a, self.on_stage)
            item = BatchItem(ids[a:b], self.session, self.pos + a, last_only=True)
            request = ForwardRequest(item, on_stage, self.recorder.check, self.recorder.recovery)
            logits = await self.pipeline.forward(request)
            self.recorder.end()
        return logits

    def finish(self) -> None:
        """Mark the decode done and emit whatever a character split across tokens left behind."""
        if self.run.decode is not None:
            self.run.decode.status = "ok"
        if not self.stopped:
            self._emit(self.stream.flush())

    def _stop_string(self, before: int) -> bool:
        """Cut the text before the first stop string it holds now that it grew from `before` characters."""
        text, stops = self.run.text, self.sampling.stop
        # A string found now ends in the new piece, so it starts less than its length before it.
        hits = [at for stop in stops if (at := text.find(stop, max(0, before - len(stop) + 1))) >= 0]
        if hits:
            self.run.text, self.stopped = text[: min(hits)], True
            self.run.finish_reason = "stop"
        return self.stopped

    def _emit(self, piece: str) -> None:
        self.run.text += piece
        if piece and self.on_text is not None:
            self.on_text(piece)


def draws(seed: int, pos: int) -> np.random.Generator:
    """The random draws for the token sampled at position `pos`: keyed by (seed, pos), never by a count.

    A step tried again (its stage died and was rebuilt), or a generation taken up again from its
    tokens, draws what the first try drew: nothing carries from one step's draw to the next.
    """
    return np.random.default_rng((seed, pos))


def spans(n: int, chunk: int) -> list[tuple[int, int]]:
    """Cut positions 0..n into consecutive spans of at most `chunk`, as even as can be.

    As even, so that no span is left with a few positions: 513 go as 257 + 256, not 512 + 1.
    """
    count = -(-n // chunk)
    return list(itertools.pairwise(n * i // count for i in range(count + 1)))


def _accumulate(timings: list[StageTiming], t: StageTiming) -> None:
    """Add one forward's stage timing to the per-stage sums."""
    for i, s in enumerate(timings):
        if s.stage == t.stage:
            timings[i] = msgspec.structs.replace(
                s, forward_ms=s.forward_ms + t.forward_ms, compute_ms=s.compute_ms + t.compute_ms
            )
            return
    timings.append(t)
