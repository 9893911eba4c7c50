"""Which threads a worker computes on: a stage is built on a thread that ends, then served from another.

The packed kernels split a product between threads with OpenMP (libgomp), and
libgomp keeps a thread pool for each thread that starts parallel work, until
that thread ends. A stage built on one thread that lives on (the worker's
event loop, an executor's thread), its kernels warmed up there, then served
from a connection's thread, leaves two pools; libgomp then counts more of its
threads than the process has cores and, as it does whenever it counts so,
throttles every waiting thread's spin from GOMP_SPINCOUNT rounds to 100: each
of a decode token's parallel products ends with its threads asleep in a futex,
to be woken at the next. Measured, SmolLM2 Q4_1 on 2 threads of 2 cores
(EPYC): a token's products were ~20-50 time slices a token on the thread that
built the stage, ~670 on a thread started after it; served, 2 threads decoded
no faster than 1. Built on a thread that then ends, the stage's only pool is
the one its serving thread starts with the first forward.

Handing every call to one long-lived compute thread instead keeps one pool as
well, but each forward then wakes two threads more: on 2 busy cores (load
~4.7), 1-thread decode served that way ran at 32 tok/s against 39 computed on
the connection's thread (medians of 9 runs, alternated), its run-queue delay
22 ms a token against 14.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
from collections import deque
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

T = TypeVar("T")


def on_own_thread(fn: Callable[[], T], name: str = "build") -> T:
    """Run `fn` on a thread of its own and wait for that thread to end; its result, or what it raised."""
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # the caller's to handle, whatever it is
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()  # a build takes what it takes: the launcher bounds it, stopping the process (BUILD_TIMEOUT)
    ok, value = outcome[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]


# ---------------------------------------------------------------- how many


# Forwards of up to this many rows are decode steps (a row a session): the ones the threads are chosen on.
DECODE_ROWS = 16
RULES = ("measured", "fixed")
# A try's step this much slower than the count in use ends the try at once.
SLOWER = 1.25


def rule_from_env() -> str:
    """RLX_THREAD_RULE if set; else `fixed` when RLX_THREADS is set (its count wins), else `measured`.

    A launcher that sizes a worker's RLX_THREADS to its share of the cores says `measured` with it.
    """
    rule = os.environ.get("RLX_THREAD_RULE", "")
    if not rule:
        return "fixed" if os.environ.get("RLX_THREADS") else "measured"
    if rule not in RULES:
        raise ValueError(f"RLX_THREAD_RULE must be one of {', '.join(RULES)}, got {rule!r}")
    return rule


class ThreadChoice:
    """The kernel threads, between 1 and `most`, a stage's decode steps are quickest on, as it serves them.

    Threads help only where the cores they need are free. Measured on 2 cores, SmolLM2 Q4_1 decode:
    2 threads are 1.38x faster than 1 with the cores idle, but with other processes running (load
    4-6) every 2-thread forward waits for both threads to be scheduled at each of its products, and
    served decode fell to 12-25 tok/s against 36-55 on 1 thread (alternated runs of 95 tokens; its
    run-queue delay 40-80 ms a token against 7-17). No count chosen at start fits both, so the stage
    keeps timing its decode steps: after `interval` of them it tries the next count down or up (half,
    double) for `probe` steps, each against the median of the last steps of as many rows on the
    count in use, and keeps whichever is faster by `margin`. A try ends at its first step when that
    step takes a quarter longer than the count in use does, as 2 threads did on busy cores by 3-8x:
    a try that loses costs one slow step, not `probe` of them. Each time the count in use wins, the
    next try waits twice as long (up to `longest` steps); a change starts the intervals again from
    `first`. The stage starts on 1 thread: if more are faster it learns so in `first` + `probe`
    steps, each at most 1.38x slower; starting on more threads on busy cores cost each of the first
    `first` steps 3-8x (served from a fresh coordinator, a 32-token run at 34 tok/s, 53 on 1 thread).
    """

    def __init__(
        self, most: int, *, probe: int = 4, first: int = 4, longest: int = 512, margin: float = 0.05
    ) -> None:
        if most < 1 or probe < 1 or first < 1 or longest < first:
            raise ValueError(f"a thread choice needs most, probe, first >= 1, longest >= first; got "
                             f"{most}, {probe}, {first}, {longest}")  # fmt: skip
        self.most, self.probe, self.first, self.longest, self.margin = most, probe, first, longest, margin
        self.current = 1
        self.interval = first
        self.tries = 0  # counts tried, for the record
        self._since = 0  # decode steps timed on `current` since the last try
        self._trying: int | None = None
        self._ratios: list[float] = []  # during a try: each step's time over the current count's median
        self._steps = 0  # steps of the try
        self._upward = False  # whether the last try went up
        self._recent: dict[tuple[int, int], deque[float]] = {}  # (threads, rows) -> last step times, ms

    def threads(self) -> int:
        """Threads for the next forward."""
        return self.current if self._trying is None else self._trying

    def timed(self, rows: int, ms: float) -> None:
        """Note that a forward of `rows` rows took `ms` on `threads()` threads."""
        if self.most == 1 or rows > DECODE_ROWS:
            return
        n = self.threads()
        if self._trying is not None:
            base = self._recent.get((self.current, rows))
            if base:
                self._ratios.append(ms / statistics.median(base))
            self._steps += 1
        self._recent.setdefault((n, rows), deque(maxlen=self.probe)).append(ms)
        if self._trying is not None:
            slower = bool(self._ratios) and self._ratios[-1] > SLOWER
            if slower or len(self._ratios) >= self.probe or self._steps >= 2 * self.probe:
                self._settle()
            return
        self._since += 1
        if self._since >= self.interval:
            self._trying, self._ratios, self._steps = self._other(), [], 0
            self.tries += 1

    def _other(self) -> int:
        """The count to try next: half or double the current one, alternating where both are possible."""
        down, up = max(1, self.current // 2), min(self.most, self.current * 2)
        self._upward = up != self.current and (down == self.current or not self._upward)
        return up if self._upward else down

    def _settle(self) -> None:
        """End a try: keep the count tried if its steps were faster by the margin."""
        assert self._trying is not None
        faster = len(self._ratios) >= self.probe and statistics.median(self._ratios) < 1 - self.margin
        if faster:
            self.current, self.interval = self._trying, self.first
        else:
            self.interval = min(2 * self.interval, self.longest)
        self._trying, self._since = None, 0


def kernels_loaded() -> ModuleType | None:
    """The compiled kernels' module if this process loaded it (its stage computes with them), else None."""
    return sys.modules.get("workers.models.kernels")
