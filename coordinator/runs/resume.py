"""Runs a coordinator that died left queued or running, taken over by the next one and run again.

An accepted run is stored with what running it again takes (stats.Accepted:
the request, the prompt's token ids, the model's and the plan's identity). A
coordinator that starts on the same file takes over the runs of one that is
gone (coordinator.store.takeover) when they match its own model and plan, and
queues them again in the order they were accepted; one that does not match is
marked interrupted saying which differs, never resumed into another model. A
generation goes on from the tokens it had stored (coordinator.runs.progress
writes them as it goes): one prefill of the prompt and those tokens, then
decode steps as before, so a greedy run ends with the tokens it would have had.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from coordinator.runs.requests import RunRequest
from coordinator.stats import Accepted, ClusterRun, Resumed
from coordinator.store.history import INTERRUPTED_ERROR
from workers.models import gguf_path
from workers.protocol.report import LayerRange


@dataclass(frozen=True)
class Identity:
    """What a run must have been accepted under to be resumed here: the model, and the plan's split."""

    model: str
    plan: str

    @classmethod
    def of(cls, spec: str, precision: str, layers: list[LayerRange]) -> Identity:
        """The identity of model `spec` split into `layers` computed in `precision`."""
        split = ", ".join(map(str, layers))
        return cls(model_identity(spec), f"{precision or 'default'} precision, layers {split}")

    def accepted(self, req: RunRequest, prompt_ids: list[int]) -> Accepted:
        """What a run of `req` keeps to be run again under this identity."""
        request = msgspec.to_builtins(req)
        return Accepted(request=request, prompt_ids=prompt_ids, model=self.model, plan=self.plan)

    def why_not(self, run: ClusterRun) -> str | None:
        """None when `run` can be resumed here; else the error it is marked interrupted with."""
        a = run.accepted
        if a is None:
            why = "it was stored without what running it again takes"
        elif a.model != self.model:
            why = f"it ran model {a.model}, and this coordinator runs {self.model}"
        elif a.plan != self.plan:
            why = f"it ran with {a.plan}, and this coordinator runs with {self.plan}"
        else:
            try:
                msgspec.convert(a.request, RunRequest)
                return None
            except msgspec.ValidationError as exc:
                why = f"its stored request is no longer valid: {exc}"
        return f"{INTERRUPTED_ERROR}; not resumed: {why}"


def model_identity(spec: str) -> str:
    """A model as a run remembers it: a GGUF file by its path, size and modification time, else its spec."""
    path = gguf_path(spec)
    if path is None:
        return spec
    st = path.resolve().stat()
    return f"{path.resolve()} ({st.st_size} bytes, modified {st.st_mtime_ns} ns)"


def restore(run: ClusterRun) -> tuple[RunRequest, list[int]]:
    """Ready a run taken over to be queued again: its request and prompt ids, its record reset to go on.

    Its timings start afresh (they are this life's); its tokens are kept, for the generation to go on
    from; when and from how many tokens it was taken over is added to `resumed`.
    """
    assert run.accepted is not None
    req = msgspec.convert(run.accepted.request, RunRequest)
    run.resumed.append(Resumed(at=time.time(), tokens=len(run.tokens), status=run.status))
    run.status, run.error, run.finish_reason = "queued", None, None
    run.timings, run.total_forward_ms, run.steps, run.steps_omitted, run.decode = [], 0.0, [], 0, None
    return req, list(run.accepted.prompt_ids)
