"""The in-process event bus: typed events, bounded subscribers, a ring buffer to resume from.

Everything that happens to runs and nodes is published here once; the event
stream, metrics, traces and the dashboard read the bus, never the runner's
internals. Publishing never waits: each subscriber has a bounded queue, and one
that falls behind loses events, then gets a single `Lagged` saying how many.
Call `publish` from the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

import msgspec

HISTORY = 2048  # events kept for clients that resume with Last-Event-ID
SUBSCRIBER_QUEUE = 1024  # events a subscriber may fall behind before it lags

NodeEventState = Literal["up", "down", "restarting", "failed", "joined", "vacant", "spare", "building"]


class Event(msgspec.Struct, tag_field="kind", kw_only=True):
    """Something that happened; `seq` and `time` are set when it is published.

    seq: the bus's sequence number, 1, 2, … (with the bus's epoch, the SSE id).
    time: Unix time of publication.
    """

    seq: int = 0
    time: float = 0.0


class RunQueued(Event, tag="run_queued", kw_only=True):
    """A run was accepted and waits its turn.

    run: the run's id. model: the model spec. queued: runs waiting, this one included.
    """

    run: int
    model: str = ""
    queued: int = 0


class RunStarted(Event, tag="run_started", kw_only=True):
    """A run began executing. run: its id."""

    run: int


class RunFinished(Event, tag="run_finished", kw_only=True):
    """A run ended and is stored.

    run: its id. status: ok, failed, interrupted or cancelled. error: why, when not ok.
    total_ms: the run's forward wall time (prefill plus decode).
    prompt_tokens, generated_tokens: token counts for generation runs (else 0).
    """

    run: int
    status: str
    error: str | None = None
    total_ms: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0


class StageForward(Event, tag="stage_forward", kw_only=True):
    """One stage finished its part of one forward.

    run: the run's id. step: 0 for the prefill or single forward, n for the n-th decode step.
    stage, addr: which node. forward_ms: send-to-reply on the coordinator's clock.
    compute_ms: the worker's own compute. positions: rows in the forward.
    """

    run: int
    step: int
    stage: int
    addr: str
    forward_ms: float
    compute_ms: float
    positions: int


class TokenGenerated(Event, tag="token", kw_only=True):
    """A generation run produced a token.

    run: the run's id. index: 0 for the first generated token.
    token: its id. text: the text it completed (may be empty mid-character).
    stage_ms: forward_ms per stage for the step that produced it, in stage order.
    """

    run: int
    index: int
    token: int
    text: str
    stage_ms: list[float] = []


class NodeChanged(Event, tag="node", kw_only=True):
    """A node changed state.

    stage: its index. addr: its address (empty while vacant). state: the new state.
    error: why it went down or failed.
    """

    stage: int
    addr: str
    state: NodeEventState
    error: str | None = None


class RunRecovering(Event, tag="run_recovering", kw_only=True):
    """A run's forward lost a stage: the run waits for the stage to be back, then refills it.

    run: its id. stage, addr: the stage and the worker it lost. at_position: where the failed forward
    began. reason: how the stage was lost. timeout_s: how long the run waits at most.
    """

    run: int
    stage: int
    addr: str
    at_position: int
    reason: str
    timeout_s: float


class RunRecovered(Event, tag="run_recovered", kw_only=True):
    """A run's lost stage is back and refilled; the run goes on from the step that failed.

    run: its id. stage: the stage. addr, new_addr: the worker lost and the one in its place.
    waited_ms: until the stage was back. replayed_positions, replay_ms: the refill.
    """

    run: int
    stage: int
    addr: str
    new_addr: str
    waited_ms: float
    replayed_positions: int
    replay_ms: float


class Lagged(Event, tag="lagged", kw_only=True):
    """This subscriber fell behind and missed `missed` events (it may resume from the ring buffer)."""

    missed: int


AnyEvent = (
    RunQueued
    | RunStarted
    | RunFinished
    | StageForward
    | TokenGenerated
    | NodeChanged
    | RunRecovering
    | RunRecovered
    | Lagged
)
KINDS = tuple(cls.__struct_config__.tag for cls in AnyEvent.__args__)


class Subscription:
    """One subscriber's bounded queue; iterate it with `async for`, or `await get()`."""

    def __init__(self, bus: EventBus, maxsize: int, accept: Callable[[Event], bool] | None) -> None:
        self._bus = bus
        self._maxsize = maxsize
        self._accept = accept
        self._queue: deque[Event] = deque()
        self._missed = 0
        self._ready = asyncio.Event()
        self.closed = False

    def offer(self, event: Event) -> None:
        """Queue `event` if it is wanted and there is room; else count it as missed."""
        if self.closed or (self._accept is not None and not self._accept(event)):
            return
        # Once lagging, drop until the consumer has drained what it holds, so the
        # Lagged marker sits exactly where the gap is.
        if self._missed or len(self._queue) >= self._maxsize:
            self._missed += 1
        else:
            self._queue.append(event)
        self._ready.set()

    async def get(self) -> Event | None:
        """The next event, a Lagged after a gap, or None once the subscription is closed."""
        while True:
            if self._queue:
                return self._queue.popleft()
            if self._missed:
                missed, self._missed = self._missed, 0
                return Lagged(missed=missed, seq=self._bus.seq, time=time.time())
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()

    def drain(self) -> list[Event]:
        """Everything queued now, with a Lagged where a gap was, without waiting."""
        got = list(self._queue)
        self._queue.clear()
        if self._missed:
            got.append(Lagged(missed=self._missed, seq=self._bus.seq, time=time.time()))
            self._missed = 0
        return got

    def close(self) -> None:
        """Stop receiving; a pending `get` returns what is queued, then None."""
        self.closed = True
        self._bus._subscribers.discard(self)
        self._ready.set()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        event = await self.get()
        if event is None:
            raise StopAsyncIteration
        return event

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class EventBus:
    """Publishes events to every subscriber and keeps the last `history` of them.

    epoch: names this bus's numbering among every bus's (every coordinator
    process's): `seq` starts again at 1 in each, so a sequence number alone
    cannot say which process it came from; an event's full id is `epoch-seq`.
    """

    def __init__(self, history: int = HISTORY) -> None:
        self.seq = 0
        # Random, not a clock: two coordinators started in the same instant still differ.
        self.epoch = secrets.token_hex(4)
        self._ring: deque[Event] = deque(maxlen=history)
        self._subscribers: set[Subscription] = set()

    @property
    def subscribers(self) -> int:
        """How many subscriptions are open."""
        return len(self._subscribers)

    def publish(self, event: Event) -> Event:
        """Number, timestamp, remember and hand `event` to every subscriber; never waits."""
        self.seq += 1
        event.seq = self.seq
        event.time = time.time()
        self._ring.append(event)
        for subscriber in list(self._subscribers):
            subscriber.offer(event)
        return event

    def subscribe(
        self,
        *,
        since: int | None = None,
        maxsize: int = SUBSCRIBER_QUEUE,
        accept: Callable[[Event], bool] | None = None,
    ) -> Subscription:
        """A new subscription; with `since`, first the remembered events after that sequence number.

        Raises LookupError when events after `since` are no longer remembered.
        """
        sub = Subscription(self, maxsize, accept)
        if since is not None:
            for event in self.after(since):
                sub.offer(event)
        self._subscribers.add(sub)
        return sub

    def after(self, seq: int) -> list[Event]:
        """The remembered events with a sequence number above `seq`; LookupError if some are gone."""
        if seq > self.seq or seq < 0:
            raise LookupError(f"event {seq} does not exist: the newest is {self.seq}")
        oldest = self._ring[0].seq if self._ring else self.seq + 1
        if seq + 1 < oldest:
            raise LookupError(
                f"events after {seq} are too old to resume from: the oldest remembered is {oldest} "
                f"(the last {self._ring.maxlen} are kept)"
            )
        return [event for event in self._ring if event.seq > seq]

    def close(self) -> None:
        """End every subscription (on shutdown): their iterators finish after what is queued."""
        for subscriber in list(self._subscribers):
            subscriber.close()
