"""A model's tensors held in the chosen precision: packed (the file's blocks) or f32.

Every matrix is used as `x @ w` with x (T, in) and gives (T, out), whatever
its storage: a float32 array (in, out), a `PackedMatrix` computed on its own
blocks (workers.models.kernels) where its type has a kernel, or a float16
`HalfMatrix` as the file stores it (workers.models.halves). What the file
stores in another type is dequantized once at load, to float32, and the
stage's precision string says so (workers.models.quants: one entry per type).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np

from workers.models import decode, dense, halves
from workers.models.gguf_file import GGUFError, GGUFFile, TensorEntry, dequantize, stored_layout
from workers.models.halves import HalfMatrix
from workers.models.kernels import PackedMatrix
from workers.models.layout import PRECISIONS as PRECISIONS  # where callers have looked for them
from workers.models.layout import check_precision
from workers.models.quants import Quant, UnknownType, by_id, held_name

Matrix = np.ndarray | PackedMatrix | HalfMatrix


def packed(raw: np.ndarray, e: TensorEntry) -> PackedMatrix:
    """A stored matrix of a type with a kernel, kept in its blocks."""
    kind = by_id(int(e.qtype), e.name).name
    decode.warm_up((kind,))  # compile (or load compiled) its type's kernels now, as part of the build
    return PackedMatrix(raw, kind, e.shape)


class TokenTable:
    """A (vocab, hidden) table: rows for the token embedding, all of it for the head."""

    def __init__(self, stored: np.ndarray | PackedMatrix | HalfMatrix) -> None:
        self.stored = stored  # float32 (vocab, hidden), or kept packed

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """The float32 rows (T, hidden) of token ids (T,)."""
        match self.stored:
            case PackedMatrix() | HalfMatrix():
                return self.stored.rows(ids)
        return self.stored[ids]

    @property
    def head(self) -> Matrix:
        """The table as a matrix (hidden, vocab): `h @ table.head` gives logits."""
        if isinstance(self.stored, np.ndarray):
            return self.stored.T
        return self.stored  # packed (vocab, hidden) blocks multiply as (hidden, vocab)


class FileTable:
    """A (vocab, hidden) table left in the file, its rows read and dequantized as they are looked up.

    The embedding of a stage that does not also multiply by it as its head: the stage holds none of
    the table. Rows are read (pread), not mapped: a mapping's page faults map the page cache's large
    folios whole (Linux 6.x, ext4), ~400 KB a row looked up in Gemma 3's table, where a read leaves
    nothing resident. A row comes out as the table held would give it (`TokenTable`), so a split
    embeds bitwise as one stage does.
    """

    def __init__(self, path: Path, e: TensorEntry, use: str) -> None:
        self.entry = e
        self.use = use  # how a held table would hold it (Loader._held)
        self.dtype, self.row_shape = stored_layout(e)[0], stored_layout(e)[1][1:]
        self.row_bytes = e.n_bytes // e.shape[0]
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)  # the file as it was opened, even if replaced later
        weakref.finalize(self, os.close, self._fd)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """The float32 rows (T, hidden) of token ids (T,)."""
        wanted, where = np.unique(ids, return_inverse=True)
        picked = np.empty((len(wanted), self.row_bytes), dtype=np.uint8)  # (U, row bytes)
        for row, token in zip(picked, wanted.tolist(), strict=True):
            got = os.preadv(self._fd, [row], self.entry.offset + token * self.row_bytes)
            if got != self.row_bytes:
                what = f"row {token} of {self.entry.name!r}"
                raise GGUFError(f"{self.path}: truncated file, {what} has {got} of {self.row_bytes} bytes")
        picked = picked.view(self.dtype).reshape(len(wanted), *self.row_shape)
        e = self.entry
        if self.use == "kernel" and e.qtype == gguf.GGMLQuantizationType.Q8_0:
            # The held table's arithmetic (PackedMatrix.rows: d·q in float32) without regrouping the rows
            # first: ~20 µs a decode token's row rather than ~200.
            blocks = picked.reshape(len(wanted), -1, 34)  # (U, blocks, d then 32 codes)
            d = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)  # (U, blocks, 1)
            rows = (d * blocks[:, :, 2:].view(np.int8).astype(np.float32)).reshape(len(wanted), -1)
        elif self.use == "kernel":
            rows = packed(picked, replace(e, shape=(len(wanted), e.shape[1]))).rows(np.arange(len(wanted)))
        elif self.use == "half":
            rows = picked.astype(np.float32)
        else:
            rows = dequantize(picked, e.qtype)
        return rows[where.reshape(-1)]


class Loader:
    """Read tensors of a file in one precision, counting the parameters held and kept packed.

    n_packed counts the parameters kept in their blocks; held names the matrices' types as held,
    a type dequantized at load as f32(type) (quants.held_name).
    """

    def __init__(self, file: GGUFFile, precision: str) -> None:
        check_precision(precision)
        self.file = file
        self.precision = precision
        self.n_params = 0
        self.n_packed = 0
        self.held: set[str] = set()

    def vector(self, name: str, size: int) -> np.ndarray:
        """A float32 vector (norm weights stay float32 in every precision)."""
        self._entry(name, (size,))
        return self.file.dequantize(name)

    def matrix(self, name: str, out: int, inp: int, rows: tuple[int, int] | None = None) -> Matrix:
        """The weight stored as (out, in), ready for `x @ w`; rows (r0, r1): only those of a fused tensor."""
        e = self._entry(name, (out, inp), rows)
        r0, r1 = rows or (0, out)
        use = self._held(e, (r1 - r0) * inp)
        if use == "kernel":
            # Regrouped from the file's mapping, which goes once the copy is made: no second copy read in.
            # Blocks run along each row, so a range of rows is a matrix of blocks.
            raw = self.file.mapped(name)
            return packed(raw[r0:r1], replace(e, shape=(r1 - r0, inp)))
        if use == "half":
            halves.warm_up()
            return HalfMatrix(self.file.raw(name)[r0:r1])
        dense.warm_up()  # the kernels of batched decode steps, compiled now, as part of the build
        rows_held = self.file.dequantize(name)[r0:r1]
        return np.ascontiguousarray(rows_held.T)  # (in, out): BLAS reads it contiguously

    def table(self, name: str, rows: int, cols: int, held: tuple[int, int] | None = None) -> TokenTable:
        """A (rows, cols) table for the embedding and the head; held (r0, r1): only those rows, of a cut head.

        Rows held are stored as the whole table stores them, so each row's logit comes out the same.
        """
        e = self._entry(name, (rows, cols), held)
        r0, r1 = held or (0, rows)
        part = replace(e, shape=(r1 - r0, cols))
        use = self._held(e, (r1 - r0) * cols)
        if use == "kernel":
            return TokenTable(packed(self.file.mapped(name)[r0:r1], part))
        if use == "half":
            halves.warm_up()
            return TokenTable(HalfMatrix(self.file.raw(name)[r0:r1]))
        table = self.file.dequantize(name)
        return TokenTable(table if held is None else table[r0:r1].copy())  # a copy: a view keeps all of it

    def file_table(self, name: str, rows: int, cols: int) -> FileTable:
        """A (rows, cols) table for the embedding only, left in the file: its rows read as looked up."""
        e = self._entry(name, (rows, cols))
        return FileTable(self.file.path, e, self._held(e))

    def precision_name(self) -> str:
        """ "f32", or the matrices' types as held, e.g. "q4_1+q8_0" or "f32(q3_k)+q4_k+q6_k"."""
        if self.precision != "packed":
            return self.precision
        return "+".join(sorted(self.held - {"f32"})) or "f32"

    def _entry(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None) -> TensorEntry:
        e = self.file.entry(name)
        if e.shape != shape:
            raise GGUFError(f"{self.file.path}: tensor {name!r} has shape {e.shape}, expected {shape}")
        self._quant(e)  # an unknown type is refused whatever the precision
        self.n_params += e.n_elements if rows is None else (rows[1] - rows[0]) * e.shape[1]
        return e

    def _quant(self, e: TensorEntry) -> Quant:
        try:
            return by_id(int(e.qtype), e.name)
        except UnknownType as exc:
            raise GGUFError(f"{self.file.path}: {exc}") from None

    def _held(self, e: TensorEntry, n_elements: int | None = None) -> str:
        """How a matrix is held: "kernel" (in its blocks), "half" (float16 as stored), else as float32.

        Named in the precision string when packed; n_packed counts the blocks kept.
        """
        q = self._quant(e)
        if self.precision != "packed":
            return "float"
        self.held.add(held_name(q))
        if q.kernel:
            self.n_packed += e.n_elements if n_elements is None else n_elements
        return q.use
