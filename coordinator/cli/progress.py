"""Show local workers building: one line per stage, redrawn in place on a terminal.

The display reads the progress lines the cluster and its launcher say while
opening (the launcher's "stage I (layers A..B): ready at ADDR, built in Ss");
a line it does not know is printed above the stages as it comes, and the
launcher's periodic "building: ..." lines are left out, since each stage's line
keeps its own clock.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from workers.protocol.report import LayerRange

# The launcher's line for a stage that has built and reported.
READY = re.compile(r"stage (?P<index>\d+) \(layers [^)]*\): ready at (?P<addr>\S+), built in (?P<built>\S+)s")
TICK = "building: "
REFRESH_PER_S = 4
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


@dataclass
class _Stage:
    """One stage's line: its layers, and once ready its address and build time."""

    layers: LayerRange
    addr: str = ""
    built: str = ""


class BuildDisplay:
    """A live view of stages building; call it with each progress line; use it as a context manager."""

    def __init__(self, ranges: list[LayerRange], console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.stages = [_Stage(layers) for layers in ranges]
        self.started = time.monotonic()
        # Stdout stays the program's own (a table, generated text), whatever the display does on stderr.
        self.live = Live(console=self.console, get_renderable=self._render, refresh_per_second=REFRESH_PER_S,
                         redirect_stdout=False)  # fmt: skip

    def __call__(self, text: str) -> None:
        if (ready := READY.match(text)) is not None and int(ready["index"]) < len(self.stages):
            stage = self.stages[int(ready["index"])]
            stage.addr, stage.built = ready["addr"], ready["built"]
            self.live.refresh()
        elif not text.startswith(TICK):
            self.console.print(text, markup=False, highlight=False)

    def _render(self) -> Group:
        elapsed = time.monotonic() - self.started
        spin = SPINNER[int(elapsed * REFRESH_PER_S) % len(SPINNER)]
        width = max(len(str(s.layers)) for s in self.stages) if self.stages else 0
        lines = []
        for i, stage in enumerate(self.stages):
            line = Text(f"stage {i}  layers {stage.layers!s:<{width}}  ")
            if stage.addr:
                line.append(f"✓ ready at {stage.addr}, built in {stage.built}s", style="green")
            else:
                line.append(f"{spin} building … {elapsed:.1f}s", style="yellow")
            lines.append(line)
        return Group(*lines)

    def __enter__(self) -> BuildDisplay:
        self.live.start(refresh=True)
        return self

    def __exit__(self, *_: object) -> None:
        self.live.stop()
