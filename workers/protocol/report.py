"""What a worker says about itself: its NodeReport and the layers it holds."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

import msgspec

from workers.protocol.address import AddressError, parse_host_port

_RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*(?:\+\s*head\s+rows\s+(\d+)\s*\.\.\s*(\d+)\s*)?$")


class HeadRows(msgspec.Struct, frozen=True):
    """Rows `start..end` (half-open) of the head: the logits of those vocabulary entries.

    start: first row held (inclusive).
    end: one past the last row held.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(f"bad head rows {self.start}..{self.end}: need 0 <= start < end (none is empty)")

    def __str__(self) -> str:
        return f"{self.start}..{self.end}"

    def __len__(self) -> int:
        return self.end - self.start


# Extra fields are left out when they hold their defaults, so a range without a head slice is
# written as it always was, {"start": 0, "end": 10}, and old readers still read it.
class LayerRange(msgspec.Struct, frozen=True, omit_defaults=True):
    """A contiguous half-open range of layers `start..end`, and the head rows its stage multiplies.

    start: first layer held (inclusive).
    end: one past the last layer held.
    head: when the head is cut across stages, the rows of it this stage holds (its range then ends
        at the last layer; a stage of head rows only holds no layers, start == end); None when it is
        not cut, and the stage ending at the last layer holds the whole head.
    """

    start: int
    end: int
    head: HeadRows | None = None

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"bad layer range {self.start}..{self.end}: need 0 <= start <= end")

    def __str__(self) -> str:
        return f"{self.start}..{self.end}" + ("" if self.head is None else f" + head rows {self.head}")

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def is_first(self) -> bool:
        """Whether this range starts the model (its stage takes the model's input)."""
        return self.start == 0

    def is_last(self, n_layers: int) -> bool:
        """Whether this range ends the model's layers (its stage holds the head, or rows of it)."""
        return self.end == n_layers

    def gives_logits(self, n_layers: int, vocab: int) -> bool:
        """Whether this stage's output is the model's logits: it holds the whole head or its last rows."""
        return self.end == n_layers and (self.head is None or self.head.end == vocab)

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """Parse `a..b`, or `a..b + head rows c..d`, as written on the command line."""
        m = _RANGE.match(text)
        if m is None:
            raise ValueError(
                f"bad layer range {text!r}: expected a..b, e.g. 0..10, or 16..18 + head rows 0..4096"
            )
        head = None if m.group(3) is None else HeadRows(int(m.group(3)), int(m.group(4)))
        return cls(int(m.group(1)), int(m.group(2)), head)


def check_stages(ranges: Sequence[LayerRange], n_layers: int, vocab: int) -> None:
    """Refuse stages that do not cover the model, naming the stage: layers in order, head rows in order.

    The layers 0..n_layers, contiguous; when the head is cut, its rows 0..vocab, contiguous, on the
    stage that runs the last layer (which applies the final norm) and on stages of head rows after it.
    """
    expected = 0
    for i, r in enumerate(ranges):
        if r.start != expected:
            raise ValueError(
                f"stage {i} (layers {r}) does not follow layer {expected}: the stages must be contiguous"
            )
        if len(r) == 0 and r.head is None:
            raise ValueError(f"stage {i} (layers {r}) holds neither layers nor head rows")
        expected = r.end
    if expected != n_layers:
        raise ValueError(f"the stages end at layer {expected}, the model has {n_layers}")
    cut = [i for i, r in enumerate(ranges) if r.head is not None]
    if not cut:
        return
    row = 0
    for i in cut:
        r = ranges[i]
        if r.end != n_layers:
            raise ValueError(
                f"stage {i} (layers {r}) holds head rows but not the last layer ({n_layers - 1})"
            )
        if r.head.start != row:
            raise ValueError(
                f"stage {i}'s head rows {r.head} do not follow row {row}: head rows must be contiguous"
            )
        row = r.head.end
    if row != vocab:
        raise ValueError(
            f"the head rows end at row {row}, the head has {vocab}: stage {cut[-1]} must end them"
        )
    if len(ranges[cut[0]]) == 0:
        first = ranges[cut[0]]
        raise ValueError(f"stage {cut[0]} (layers {first}) holds no layers: the head's first rows go on "
                         "the stage that runs the last layer, which applies the final norm")  # fmt: skip


class NodeReport(msgspec.Struct, frozen=True):
    """The one JSON line a worker prints on stdout once built and listening.

    Field names and shapes are a contract (see DESIGN.md); extra fields may be
    added and readers ignore fields they do not know.

    addr: `host:port` the worker really listens on.
    layers: the layer range this stage holds.
    device: where compute runs ("cpu").
    precision: "f32", or the matrices' types as held (e.g. "q4_1+q8_0"; a type dequantized to
        float32 at load as f32(type), e.g. "f32(q3_k)+q4_k+q6_k").
    build_ms: wall time to build the stage, in milliseconds.
    resident_bytes: the process's resident set after build, measured.
    n_params: parameters this stage holds.
    n_packed: parameters kept in their packed (quantized) form.
    pid: the worker's process id.
    model: the model spec the stage was built from.
    """

    addr: str
    layers: LayerRange
    device: str
    precision: str
    build_ms: int
    resident_bytes: int
    n_params: int
    n_packed: int = 0
    pid: int = 0
    model: str = ""


_report_decoder = msgspec.json.Decoder(NodeReport)


def encode_report(report: NodeReport) -> str:
    """Render a report as its one JSON line (no newline)."""
    return msgspec.json.encode(report).decode()


def decode_report(line: str | bytes) -> NodeReport:
    """Parse one line as a NodeReport; raise ValueError naming what is wrong."""
    try:
        report = _report_decoder.decode(line)
    except (msgspec.DecodeError, RecursionError) as exc:  # deep nesting, even in ignored fields
        raise ValueError(f"not a NodeReport: {exc}") from exc
    try:
        parse_host_port(report.addr)
    except AddressError as exc:
        raise ValueError(f"not a NodeReport: addr: {exc}") from None
    return report


def resident_bytes() -> int:
    """Measure this process's resident set size (VmRSS) in bytes."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # fallback for systems without /proc: peak, not current

    # ru_maxrss is in bytes on macOS, in kibibytes on Linux and the BSDs.
    unit = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
