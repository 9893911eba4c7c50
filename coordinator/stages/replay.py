"""What each stage was sent, per session, so that a worker that takes a stage's place can be refilled.

As Petals' client does with its servers, the pipeline keeps, per session and
stage, the inputs it sent that stage (token ids for the first, hidden states
after), and which worker took them. When a forward reaches a stage whose
worker is not the one that holds the session (it died and was restarted, or
another joined in its place), the new worker is first sent the session's
earlier inputs as one prefill (in chunks of REPLAY_CHUNK) and so rebuilds the
cache the old one lost; the other stages keep theirs. The log is bounded by
what a session may hold: one row per position, at most the model's context,
per stage; a step tried again replaces the rows it had sent from its position.
It is kept on the forward threads and dropped on the loop: one lock guards it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from coordinator.stages.client import WorkerClient
from coordinator.stats import Recovery
from workers.protocol.info import BatchItem

# Positions sent at once at most when refilling a stage, as the prompt is chunked
# (coordinator.runs.generation.PREFILL_CHUNK): no replay forward outlasts the forward timeout
# more than a prompt chunk would.
REPLAY_CHUNK = 512
# One session's rows in a forward's input: (session, start_pos, rows).
Part = tuple[str, int, np.ndarray]
# Told when a forward's stage is lost (its Recovery so far, and why) and once it is refilled (why None).
RecoveryHook = Callable[[str, Recovery, str | None], None]


def no_recovery_hook(session: str, recovery: Recovery, reason: str | None) -> None:
    """The recovery hook of a forward nobody records."""


@dataclass
class _Kept:
    """One session's inputs to one stage: the worker that has them, and the rows, in position order."""

    client: WorkerClient
    segments: list[tuple[int, np.ndarray]] = field(default_factory=list)

    def rows_before(self, pos: int) -> np.ndarray | None:
        """Positions 0..pos as one array, or None when the log does not hold all of them."""
        rows = [x[: pos - start] for start, x in self.segments if start < pos]
        if not rows or sum(len(r) for r in rows) != pos:
            return None
        return np.concatenate(rows)


@dataclass(frozen=True)
class Refill:
    """A new worker at `stage` was sent a session's earlier positions before its forward went on."""

    session: str
    stage: int
    addr: str
    new_addr: str
    positions: int
    ms: float


class InputLog:
    """Per session and stage, the inputs sent and the worker that took them (see the module)."""

    def __init__(self) -> None:
        self._kept: dict[str, dict[int, _Kept]] = {}
        self._lock = threading.Lock()

    def keep(self, stage: int, client: WorkerClient, parts: list[Part]) -> None:
        """Note that `client`, at `stage`, took these sessions' rows (a step tried again replaces its own)."""
        with self._lock:
            for session, start, x in parts:
                stages = self._kept.setdefault(session, {})
                kept = stages.get(stage)
                if kept is None or start == 0:
                    kept = stages[stage] = _Kept(client)
                kept.client = client
                segments = kept.segments
                # A step that goes on where the last ended (every decode step) is appended; only a step
                # tried again cuts back what it replaces, so a long run's steps cost one each, not n.
                if segments and segments[-1][0] + len(segments[-1][1]) > start:
                    kept.segments = segments = [(s, r[: start - s]) for s, r in segments if s < start]
                segments.append((start, x))

    def missing(
        self, stage: int, client: WorkerClient, session: str, start: int
    ) -> tuple[str, np.ndarray] | None:
        """What `client` lacks of `session` before `start` at `stage`: (the old worker's addr, the rows).

        None when it holds them (it took them) or there is nothing to refill (a forward from position 0,
        a session the log never saw, or one whose rows the log does not hold in full).
        """
        with self._lock:
            kept = self._kept.get(session, {}).get(stage)
            if start == 0 or kept is None or kept.client is client:
                return None
            rows = kept.rows_before(start)
        return None if rows is None else (kept.client.addr, rows)

    def refill(self, stage: int, client: WorkerClient, parts: list[Part], timeout: float) -> list[Refill]:
        """Send `client` what it lacks of each session before the forward of `parts` (blocking).

        Raises the client's WorkerError when the worker fails the refill.
        """
        done = []
        for session, start, _ in parts:
            if (lacking := self.missing(stage, client, session, start)) is None:
                continue
            addr, rows = lacking
            began = time.monotonic()
            for a in range(0, len(rows), REPLAY_CHUNK):
                chunk = rows[a : a + REPLAY_CHUNK]
                client.forward_now(BatchItem(chunk, session, a, last_only=True), timeout=timeout)
            self.keep(stage, client, [(session, 0, rows)])
            done.append(
                Refill(session, stage, addr, client.addr, len(rows), (time.monotonic() - began) * 1000)
            )
        return done

    def drop(self, session: str) -> None:
        """Forget a session (it ended)."""
        with self._lock:
            self._kept.pop(session, None)

    def nbytes(self, session: str) -> int:
        """Bytes the log holds for `session`, every stage together."""
        with self._lock:
            stages = self._kept.get(session, {})
            return sum(x.nbytes for kept in stages.values() for _, x in kept.segments)
