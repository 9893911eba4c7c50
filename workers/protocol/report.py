"""What a worker says about itself: its NodeReport and the layers it holds."""

from __future__ import annotations

import re
import sys

import msgspec

from workers.protocol.address import AddressError, parse_host_port

_RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")


class LayerRange(msgspec.Struct, frozen=True):
    """A contiguous half-open range of layers `start..end`.

    start: first layer held (inclusive).
    end: one past the last layer held.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"bad layer range {self.start}..{self.end}: need 0 <= start <= end")

    def __str__(self) -> str:
        return f"{self.start}..{self.end}"

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def is_first(self) -> bool:
        """Whether this range starts the model (its stage takes the model's input)."""
        return self.start == 0

    def is_last(self, n_layers: int) -> bool:
        """Whether this range ends a model of `n_layers` (its stage gives the model's output)."""
        return self.end == n_layers

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """Parse `a..b` as written on the command line."""
        m = _RANGE.match(text)
        if m is None:
            raise ValueError(f"bad layer range {text!r}: expected a..b, e.g. 0..10")
        return cls(int(m.group(1)), int(m.group(2)))


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
