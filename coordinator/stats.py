"""Per-stage timings and the ClusterRun they add up to, with the seed's semantics."""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

from workers.protocol.report import LayerRange

GB = 1e9
NODE_WIDTH = 22
LAYERS_WIDTH = 10
RULE = 74
# Decode steps whose per-stage timings a run record keeps (the last ones); older ones are only counted.
KEPT_STEPS = 256
RunStatus = Literal["queued", "running", "ok", "failed", "interrupted", "cancelled"]
# Why a generation stopped: "stop" (the end-of-sequence token or a stop string), "length" (the token
# budget or the context ran out) or "cancelled".
FinishReason = Literal["stop", "length", "cancelled"]


class ReduceKind(enum.Enum):
    """How resident memory is reduced over stages."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"


class StageTiming(msgspec.Struct, kw_only=True):
    """What one stage cost in a run.

    addr: the worker's `host:port`.
    layers: the layers the stage holds.
    device: where it computes.
    build_ms: time the worker took to build the stage.
    forward_ms: send-to-reply wall time on the coordinator's monotonic clock
        (network + compute).
    resident_bytes: the worker's resident set after build.
    compute_ms: the worker's own compute time for the forward.
    stage: the stage's index in the pipeline.
    precision: the stage's precision as reported.
    """

    addr: str
    layers: LayerRange
    device: str
    build_ms: int
    forward_ms: float
    resident_bytes: int
    compute_ms: float
    stage: int = 0
    precision: str = ""


class StepTiming(msgspec.Struct, kw_only=True):
    """One forward of a run, stage by stage; times in ms after the run started, on the coordinator's clock.

    step: 0 for the prefill (each chunk of a long prompt is a forward of its own) or the single
        forward, n for the n-th decode step.
    positions: rows forwarded.
    start_ms: when the step began.
    wall_ms: how long it took, the coordinator's own work (encoding, sampling) included.
    stage_start_ms: when each stage was sent its input, in stage order.
    forward_ms, compute_ms: each stage's, in stage order, as in StageTiming.
    replayed: the stages this forward waited for and refilled first (their new worker was sent the
        session's earlier inputs, see Recovery): their times here are the step's own forward alone.
    """

    step: int
    positions: int
    start_ms: float
    wall_ms: float = 0.0
    stage_start_ms: list[float] = []
    forward_ms: list[float] = []
    compute_ms: list[float] = []
    replayed: list[int] = []


class Recovery(msgspec.Struct, kw_only=True):
    """A stage that went down under a run and was rebuilt for it; times in ms on the coordinator's clock.

    stage, addr: the stage that went down and the worker it had. new_addr: the worker that took its place.
    at_position: the first position of the forward that failed (the step taken again).
    start_ms: when the run began waiting, after the run started. waited_ms: until the stage was back.
    replayed_positions: the session's earlier positions sent to the new worker (one prefill) to rebuild
        its cache. replay_ms: what sending them took.
    """

    stage: int
    addr: str
    new_addr: str = ""
    at_position: int = 0
    start_ms: float = 0.0
    waited_ms: float = 0.0
    replayed_positions: int = 0
    replay_ms: float = 0.0


class Accepted(msgspec.Struct, kw_only=True):
    """What a restarted coordinator needs to run an accepted run again, kept with it from the start.

    request: the run's request as accepted (a RunRequest's fields).
    prompt_ids: a language model's prompt as the token ids it was encoded to then (a chat template
        or tokenizer changed since cannot change what is resumed).
    model: which model ran it: the spec, or for a GGUF file its path, size and modification time.
    plan: how the layers were split and computed: the precision and each stage's layers.
    """

    request: dict[str, Any]
    prompt_ids: list[int] = []
    model: str = ""
    plan: str = ""


class Resumed(msgspec.Struct, kw_only=True):
    """A restarted coordinator took the run over from one that had died.

    at: Unix time it was taken over.
    tokens: generated tokens it had stored by then, which the resumed run continued from.
    status: what it was left as: "queued" or "running".
    """

    at: float
    tokens: int
    status: RunStatus


class ClusterRun(msgspec.Struct, kw_only=True):
    """One run through the pipeline: its timings, total and output.

    timings: the stages finished so far, in pipeline order (a prompt's summed over its chunks).
    total_forward_ms: wall time of the whole forward (all stages).
    output: the last stage's output, flattened.
    id: the run's id (assigned when stored).
    status: "queued", "running", "ok", "failed", "interrupted" or "cancelled".
    seq: positions in the forward (prompt tokens for a generation run).
    error: what went wrong, naming the stage and address, when failed.
    model: the model spec.
    created_at, finished_at: Unix times.
    prompt, text, tokens: a generation run's prompt, generated text and ids.
    decode: a generation run's decode steps taken together: `seq` generated
        tokens, per-stage times summed over steps, total = decode wall time.
    output_shape: the last stage's output shape before flattening ([] when none).
    output_digest: SHA-256 (hex) of the output's float32 bytes in C order.
    output_omitted: the output was too big to store (store.MAX_STORED_OUTPUT
        floats): `output` is empty; `output_shape` and `output_digest` describe it.
    steps: each forward's per-stage timing (what a trace is drawn from): the
        prefill's forwards (one per chunk of the prompt) or the single forward,
        and the last KEPT_STEPS decode steps.
    steps_omitted: decode steps left out of `steps` (the oldest after the prefill).
    finish_reason: why a generation run stopped (see FinishReason); None for a run that
        generated nothing (a forward of activations, one that never started or failed).
    accepted: what running it again takes (None for runs stored before runs kept it).
    resumed: each time a restarted coordinator took the run over; its timings are those of the
        last life only, its tokens run on from what was stored.
    recoveries: each stage that went down under the run and was rebuilt for it, in order.
    """

    timings: list[StageTiming]
    total_forward_ms: float
    output: list[float]
    id: int = 0
    status: RunStatus = "ok"
    seq: int = 0
    error: str | None = None
    model: str = ""
    created_at: float = 0.0
    finished_at: float | None = None
    prompt: str | None = None
    text: str | None = None
    tokens: list[int] = []
    decode: ClusterRun | None = None
    output_shape: list[int] = []
    output_digest: str | None = None
    output_omitted: bool = False
    steps: list[StepTiming] = []
    steps_omitted: int = 0
    finish_reason: FinishReason | None = None
    accepted: Accepted | None = None
    resumed: list[Resumed] = []
    recoveries: list[Recovery] = []

    def tokens_per_s(self, seq: int) -> float:
        """Positions per second over the whole forward; 0.0 when no time passed."""
        if self.total_forward_ms == 0:
            return 0.0
        return seq / (self.total_forward_ms / 1000)

    def reduce_resident_gb(self, kind: ReduceKind | str) -> float:
        """Resident memory over stages in GB (1e9 bytes); 0.0 with no stages."""
        kind = ReduceKind(kind)
        values = [t.resident_bytes / GB for t in self.timings]
        if not values:
            return 0.0
        match kind:
            case ReduceKind.SUM:
                return sum(values)
            case ReduceKind.MEAN:
                return sum(values) / len(values)
            case ReduceKind.MAX:
                return max(values)
            case ReduceKind.MIN:
                return min(values)

    def critical_path_ms(self) -> float:
        """The slowest stage's forward time: the pipeline's bottleneck."""
        return max((t.forward_ms for t in self.timings), default=0.0)

    def table(self) -> str:
        """The monitor table; a generation run's decode table follows its prefill one."""
        node = max([NODE_WIDTH] + [len(t.addr) + 1 for t in self.timings])
        # A stage of a cut head names its rows too ("17..18 + head rows 0..128672"): wider, as a long address.
        layers = max([LAYERS_WIDTH] + [len(str(t.layers)) + 1 for t in self.timings])
        rule = "─" * (RULE + node - NODE_WIDTH + layers - LAYERS_WIDTH) + "\n"
        lines = [
            f"{'node':<{node}}{'layers':<{layers}}{'device':<8}{'build':>10}{'forward':>12}{'resident':>12}\n",
            rule,
        ]
        for t in self.timings:
            lines.append(
                f"{t.addr:<{node}}{t.layers!s:<{layers}}{t.device:<8}"
                f"{t.build_ms / 1000:>9.1f}s{t.forward_ms / 1000:>11.1f}s"
                f"{t.resident_bytes / GB:>10.1f}G\n"
            )
        n = len(self.timings)
        if n == 0:
            lines.append("(no stages)\n")
        lines.append(rule)
        lines.append(
            f"reduce: Σ resident {self.reduce_resident_gb(ReduceKind.SUM):.1f} GB, "
            f"max resident {self.reduce_resident_gb(ReduceKind.MAX):.1f} GB | "
            f"total forward {self.total_forward_ms / 1000:.1f}s, "
            f"critical path {self.critical_path_ms() / 1000:.1f}s across {n} stage{'' if n == 1 else 's'}\n"
        )
        if self.decode is not None:
            d = self.decode
            lines.append(f"\ndecode: {d.seq} tokens, {d.tokens_per_s(d.seq):.1f} tokens/s\n")
            lines.append(d.table())
        return "".join(lines)
