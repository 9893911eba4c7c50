"""What a model costs from its architecture: weight bytes and FLOPs per layer, bytes per hop.

A planner for hosts it does not have (or a model it does not hold) cannot time
layers, so it counts them: per layer the bytes of its weights (read once per
forward, whatever its rows: what bounds a decode step on a CPU) and the FLOPs
per row (what bounds a prompt), from the hyper-parameters a GGUF file states
(workers.models.arch) or given as numbers. A host turns them into time with
two rates: weight bytes streamed per second and FLOPs per second.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bits per weight of a file quantized by llama.cpp's mixes: the mix's blocks averaged over a Llama's
# matrices (Q4_K_M: a 70B file of 42.5 GB for 70.6e9 weights), and the type its head is kept in.
MIXES: dict[str, tuple[float, float]] = {
    "F32": (32.0, 32.0),
    "F16": (16.0, 16.0),
    "Q8_0": (8.5, 8.5),
    "Q6_K": (6.5625, 6.5625),
    "Q5_K_M": (5.69, 6.5625),
    "Q4_K_M": (4.85, 6.5625),
    "Q4_0": (4.5, 6.5625),
}
# Activations cross the wire as float32 rows; token ids as int32 (workers.protocol.wire).
F32 = 4
TOKEN_BYTES = 4
# Positions each layer's attention reads at a decode step, when a plan does not say: a short chat's.
CONTEXT = 512


class CostModelError(ValueError):
    """A model's shape that cannot be costed."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's hyper-parameters, as far as its cost goes.

    name: how a person knows it.
    quant: the llama.cpp mix its weights are in (a key of MIXES); decides bits per weight.
    layer_bytes: each layer's weight bytes when known from a file (else from the mix's bits).
    head_bytes: the head's (and final norm's) bytes when known from a file.
    tied: whether the head is the token embedding (held once, by the last stage).
    """

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    quant: str = "Q4_K_M"
    head_dim: int = 0
    layer_bytes: tuple[int, ...] = ()
    head_bytes: int = 0
    tied: bool = False

    def __post_init__(self) -> None:
        for field in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CostModelError(
                    f"model {self.name!r}: {field} must be a whole number >= 1, got {value!r}"
                )
        if self.n_heads % self.n_kv_heads:
            raise CostModelError(
                f"model {self.name!r}: heads {self.n_heads} is not a multiple of kv_heads {self.n_kv_heads}"
            )
        if self.quant not in MIXES:
            raise CostModelError(
                f"model {self.name!r}: unknown quant {self.quant!r}; known: {', '.join(MIXES)}"
            )
        if self.layer_bytes and len(self.layer_bytes) != self.n_layers:
            raise CostModelError(
                f"model {self.name!r}: {len(self.layer_bytes)} layer sizes for {self.n_layers}"
            )

    @property
    def hd(self) -> int:
        """Each head's width."""
        return self.head_dim or self.hidden // self.n_heads

    def layer_weights(self) -> int:
        """Weights of one block: q, k, v, o and a gated FFN's gate, up and down (norms are noise)."""
        q = self.n_heads * self.hd
        kv = self.n_kv_heads * self.hd
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.ffn

    def weight_bytes(self) -> list[float]:
        """Bytes each layer reads per forward; the last layer's holds the head's (as calibration times it)."""
        bits, head_bits = MIXES[self.quant]
        layers = [float(b) for b in self.layer_bytes] or [self.layer_weights() * bits / 8] * self.n_layers
        layers[-1] += self.head_bytes or self.vocab * self.hidden * head_bits / 8
        return layers

    def row_flops(self, context: int = CONTEXT) -> list[float]:
        """FLOPs each layer spends per row: two a weight, plus attention over `context` positions."""
        attention = 4 * self.n_heads * self.hd * context  # q·k and the weighted sum of v
        layers = [2.0 * self.layer_weights() + attention] * self.n_layers
        layers[-1] += 2.0 * self.vocab * self.hidden
        return layers

    def held_bytes(self, start: int, end: int) -> float:
        """Memory a stage holding layers start..end keeps: its weights (the head on the last)."""
        return sum(self.weight_bytes()[start:end])

    def in_bytes(self, first: bool, rows: int) -> int:
        """Bytes a stage is sent for `rows` positions: token ids to the first, hidden rows to the others."""
        return rows * (TOKEN_BYTES if first else self.hidden * F32)

    def out_bytes(self, last: bool, rows: int) -> int:
        """Bytes a stage sends back: the last stage's logits (one row a forward), else hidden rows."""
        return self.vocab * F32 if last else rows * self.hidden * F32


def from_numbers(name: str, fields: dict) -> ModelShape:
    """A shape from a hosts file's [model] table: layers, hidden, heads, kv_heads, ffn, vocab, quant."""
    known = {"layers": "n_layers", "hidden": "hidden", "heads": "n_heads", "kv_heads": "n_kv_heads",
             "ffn": "ffn", "vocab": "vocab", "quant": "quant", "head_dim": "head_dim",
             "tied": "tied"}  # fmt: skip
    unknown = sorted(set(fields) - set(known) - {"name"})
    if unknown:
        raise CostModelError(
            f"model {name!r}: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}"
        )
    missing = [k for k in ("layers", "hidden", "heads", "ffn", "vocab") if k not in fields]
    if missing:
        raise CostModelError(f"model {name!r}: missing {', '.join(missing)}")
    args = {known[k]: v for k, v in fields.items() if k != "name"}
    args.setdefault("n_kv_heads", args["n_heads"])
    return ModelShape(name=name, **args)


def from_spec(spec: str) -> ModelShape:
    """The shape of a GGUF model here: hyper-parameters from its metadata, bytes from its tensors."""
    # Imported here: only a plan of a model on this machine reads a file.
    from workers.models import GGUFModel, parse
    from workers.models.arch import read_params
    from workers.models.footprint import footprint
    from workers.models.gguf_file import open_gguf

    model = parse(spec)
    if not isinstance(model, GGUFModel):
        raise CostModelError(f"model {spec!r} is not a GGUF file: give its shape in the hosts file's [model]")
    p = read_params(open_gguf(model.path))
    foot = footprint(spec, "packed")
    head = foot.head + (foot.embedding if foot.tied else 0)
    return ModelShape(name=spec, n_layers=p.n_layers, hidden=p.hidden, n_heads=p.n_heads,
                      n_kv_heads=p.n_kv_heads, ffn=p.ffn, vocab=p.vocab, head_dim=p.head_dim,
                      layer_bytes=tuple(foot.layers), head_bytes=head, tied=foot.tied)  # fmt: skip


# A 70B-class Llama (Llama 3 70B's hyper-parameters), for planning a model this machine does not hold.
LLAMA_70B = ModelShape(
    name="llama-70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, ffn=28672, vocab=128256
)
