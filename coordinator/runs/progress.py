"""Write the running generations' tokens to the store as they come: batched, off the event loop.

Every PROGRESS_EVERY_S the records of the runs whose tokens grew since
their last write are written in one transaction on the store's thread
(RunStore.save_progress), so a coordinator that dies loses at most that much
of each run: the next one resumes it from what was written (coordinator.runs.resume).
A write that fails (the file locked, full) is tried again at the next tick;
the run goes on. `cost_per_token` says what the writes cost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress

import msgspec

from coordinator.stats import ClusterRun
from coordinator.store.history import RunStore, StoreError

log = logging.getLogger("coordinator.runs.progress")

# Seconds between writes of the running runs' progress: what a coordinator's death may lose at most
# (half of the second the design allows, so a write that waits on the store's lock still keeps it).
PROGRESS_EVERY_S = 0.5


class Progress:
    """Writes the progress of the runs `running` returns, every `every` seconds."""

    def __init__(
        self, store: RunStore, running: Callable[[], list[ClusterRun]], every: float = PROGRESS_EVERY_S
    ) -> None:
        self.store, self.running, self.every = store, running, every
        self._written: dict[int, int] = {}  # tokens of each run as last written
        self.writes = self.tokens = 0  # transactions written, and new tokens they carried
        self.seconds = 0.0  # their time, from asking the store's thread to its commit
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start writing."""
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        """Stop writing (each run's end is saved by the runner itself)."""
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task

    def cost_per_token(self) -> float:
        """Seconds of writing per generated token written so far (0.0 before any)."""
        return self.seconds / self.tokens if self.tokens else 0.0

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            try:
                await self.write()
            except StoreError as exc:
                log.info("progress not written (tried again in %g s): %s", self.every, exc)

    async def write(self) -> None:
        """Write the records of the runs whose tokens grew since they were last written."""
        running = self.running()
        self._written = {r.id: self._written[r.id] for r in running if r.id in self._written}
        grown = [r for r in running if r.tokens and len(r.tokens) != self._written.get(r.id)]
        if not grown:
            return
        # Copies of the lists the loop appends to; the rest is encoded on the store's thread by msgspec,
        # which holds the GIL while it encodes, so it reads each record as one moment left it.
        snaps = [msgspec.structs.replace(r, tokens=list(r.tokens), steps=list(r.steps)) for r in grown]
        started = time.perf_counter()
        await self.store.save_progress(snaps)
        self.seconds += time.perf_counter() - started
        self.writes += 1
        self.tokens += sum(len(r.tokens) - self._written.get(r.id, 0) for r in snaps)
        self._written.update((r.id, len(r.tokens)) for r in snaps)
