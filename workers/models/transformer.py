"""A GGUF transformer (any architecture of workers.models.arch) as pipeline stages, computed in numpy.

Stage 0 embeds token ids, the last stage applies the final norm and the head
(or, when the head's rows are cut across stages, the stage of the last layer
applies the norm and its rows, and stages of head rows only append theirs);
every block is workers.models.block's reference, the same wherever it runs, so
any split of the blocks computes bitwise the same logits as one stage, given
the same BLAS with the same thread count (OpenBLAS's results change with
OPENBLAS_NUM_THREADS, in the last bits). A stage whose blocks are all packed,
of a model the compiled path supports (decode.supports), computes a few rows
(decode steps, short prompts) in compiled code instead (workers.models.decode),
the same on every stage and thread count; where it does not, the reference runs.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from workers.models import decode, kernels
from workers.models.arch import ModelParams, read_params
from workers.models.block import BlockWeights, Run, block, load_block
from workers.models.dense import product
from workers.models.gguf_file import open_gguf
from workers.models.kernels import PackedMatrix
from workers.models.kvcache import KVCache
from workers.models.layout import check_precision
from workers.models.ops import rms_norm, rope_tables
from workers.models.weights import FileTable, Loader, Matrix, TokenTable
from workers.protocol.info import BatchItem, ModelInfo
from workers.protocol.report import LayerRange
from workers.stage import StageError, check_hidden

MAX_SESSIONS = 8


def describe(path: Path, name: str) -> ModelInfo:
    """Read the model's shape from the file's metadata, without loading tensors."""
    return model_info(read_params(open_gguf(path)), name)


def model_info(p: ModelParams, name: str) -> ModelInfo:
    """What the coordinator needs of a model with hyper-parameters `p`."""
    return ModelInfo(
        name=name,
        n_layers=p.n_layers,
        input="tokens",
        hidden=p.hidden,
        vocab=p.vocab,
        context_length=p.context_length,
        max_sessions=MAX_SESSIONS,
    )


def all_packed(w: BlockWeights) -> bool:
    """Whether every matrix of a block is packed in a type with a kernel, as workers.models.decode needs."""
    return all(isinstance(getattr(w, name), PackedMatrix) for name in decode.MATRICES)


# ---------------------------------------------------------------- the stage


class TransformerStage:
    """Blocks `layers` of a GGUF transformer, with per-session KV caches."""

    def __init__(
        self,
        info: ModelInfo,
        layers: LayerRange,
        params: ModelParams,
        blocks: list[BlockWeights],
        token_embd: TokenTable | FileTable | None,
        output_norm: np.ndarray | None,
        head: Matrix | None,
        precision: str,
        n_params: int,
        n_packed: int,
    ) -> None:
        self.info = info
        self.layers = layers
        self.params = params
        self.blocks = blocks
        self.token_embd = token_embd
        self.output_norm = output_norm
        self.head = head
        self.precision = precision
        self.n_params = n_params
        self.n_packed = n_packed
        # Why a few rows do not take the compiled path (workers.models.decode), or None when they do.
        self.not_compiled = compiled_refusal(params, layers, blocks)
        compiled = self.not_compiled is None
        self._compiled_blocks = decode.stack(blocks) if compiled else None
        self._cache_lists = decode.cache_lists() if compiled else None  # a forward at a time uses them
        self._sessions: OrderedDict[str, KVCache] = OrderedDict()
        # forward and reset run on the server's compute thread, while a stats
        # request calls n_sessions() and kv_bytes() from the event loop, in the middle of them.
        self._lock = threading.Lock()

    def forward(self, x: np.ndarray, *, session: str, start_pos: int, last_only: bool) -> np.ndarray:
        """Run the blocks on x at positions start_pos..; logits (T or 1, vocab) on the last stage."""
        x = self._check_input(x)
        if not self.blocks:  # head rows only: no positions, no cache; the rows as the stage before sent them
            return self._head(x, operator.matmul)
        T = x.shape[0]
        cache = self._cache(session, start_pos, T)
        cache.reserve(start_pos + T)
        h = self._embed(x)
        h = self._blocks(h, [(cache, start_pos, 0, T)], np.arange(start_pos, start_pos + T))
        cache.length = start_pos + T  # only once every block holds the new positions
        if not self.layers.is_last(self.info.n_layers):
            return h
        if last_only:
            h = h[-1:]
        return self._head(h, operator.matmul)

    def forward_batch(self, items: list[BatchItem]) -> list[np.ndarray]:
        """Run one decode row per session (distinct sessions) as one batch; other batches item by item.

        Every item is checked, and its session's cache found, before anything is computed, so a
        refused batch leaves every cache as it was.
        """
        distinct = len({item.session for item in items}) == len(items)
        if len(items) < 2 or not distinct or any(item.x.shape[:1] != (1,) for item in items):
            return [self.forward(x, session=s, start_pos=pos, last_only=lo) for x, s, pos, lo in items]
        xs = [self._check_input(item.x) for item in items]
        if not self.blocks:
            h = self._head(np.concatenate(xs), product)  # (B, hidden + head.end), or (B, vocab)
            return [h[b : b + 1] for b in range(len(items))]
        caches = [self._cache(item.session, item.start_pos, 1) for item in items]
        for cache, item in zip(caches, items, strict=True):
            cache.reserve(item.start_pos + 1)
        runs = [
            (cache, item.start_pos, b, b + 1)
            for b, (cache, item) in enumerate(zip(caches, items, strict=True))
        ]
        positions = np.array([item.start_pos for item in items])  # row b rotated at its own position
        h = self._blocks(self._embed(np.concatenate(xs)), runs, positions)  # x: (B,) ids or (B, hidden)
        for cache, item in zip(caches, items, strict=True):
            cache.length = item.start_pos + 1
        if self.layers.is_last(self.info.n_layers):
            h = self._head(h, product)  # (B, vocab), or what the next of a cut head's stages takes
        return [h[b : b + 1] for b in range(len(items))]

    def _head(self, h: np.ndarray, multiply: Callable[[np.ndarray, Matrix], np.ndarray]) -> np.ndarray:
        """The logits (T, vocab); on a cut head, what its next stage takes: normed rows, the logits so far.

        The stage that runs the last layer applies the final norm; a stage of head rows only takes the
        normed rows and the logits before its own (T, hidden + head.start), and appends its rows' logits.
        Each logit is one row's dot product, so a head cut on row groups gives bitwise the logits of a
        whole one: on the packed kernels, and through BLAS for one row (a many-row BLAS product of a
        float32 slice may round otherwise in the last bits than the whole table's does).
        """
        hidden, rows = self.params.hidden, self.layers.head
        if self.blocks:
            normed, before = rms_norm(h, self.output_norm, np.float32(self.params.eps)), h[:, :0]
        else:
            normed, before = h[:, :hidden], h[:, hidden:]  # (T, hidden), (T, head.start)
        logits = multiply(normed, self.head)  # (T, rows held)
        if rows is None:
            return logits
        if rows.end == self.params.vocab:
            return np.concatenate([before, logits], axis=1)  # (T, vocab)
        return np.concatenate([normed, before, logits], axis=1)  # (T, hidden + head.end)

    def _embed(self, x: np.ndarray) -> np.ndarray:
        """Token ids to their rows (× the architecture's embedding scale) on the first stage; else x."""
        if not self.layers.is_first:
            return x
        h = self.token_embd.embed(x)
        scale = self.params.embed_scale
        return h if scale == 1.0 else h * np.float32(scale)

    def _blocks(self, h: np.ndarray, runs: list[Run], positions: np.ndarray) -> np.ndarray:
        """The stage's blocks on rows h (row t at positions[t]): compiled for a few rows where it can."""
        p, layers = self.params, range(self.layers.start, self.layers.end)
        tables = {rope: rope_tables(positions, p.head_dim, rope) for rope in {p.rope[i] for i in layers}}
        if self.compiled and h.shape[0] <= kernels.KERNEL_MAX_ROWS:
            return self._compiled(h, runs, tables)
        for index, (layer, w) in enumerate(zip(layers, self.blocks, strict=True)):
            h = block(h, w, p, layer, index, runs, tables[p.rope[layer]])
        return h

    @property
    def compiled(self) -> bool:
        """Whether a few rows take the compiled path (see `not_compiled` for why not)."""
        return self._compiled_blocks is not None

    def _compiled(self, h: np.ndarray, runs: list[Run], tables: dict) -> np.ndarray:
        """The blocks on rows h through workers.models.decode; runs and tables as decode.blocks takes them."""
        # Rows from the wire are read-only: copied (a few KB), as compiled code takes them writable.
        h = np.array(h, dtype=np.float32, order="C", copy=True if not h.flags.writeable else None)
        layers = range(self.layers.start, self.layers.end)
        return decode.blocks(h, self._compiled_blocks, self.params, layers, runs, tables, self._cache_lists)

    def reset(self, session: str) -> None:
        """Free the KV cache of `session`, if held."""
        with self._lock:
            self._sessions.pop(session, None)

    def n_sessions(self) -> int:
        """Sessions currently holding a KV cache."""
        with self._lock:
            return len(self._sessions)

    def kv_bytes(self) -> dict[str, int]:
        """Each session's KV cache bytes, by session."""
        with self._lock:
            return {session: cache.nbytes() for session, cache in self._sessions.items()}

    def _check_input(self, x: np.ndarray) -> np.ndarray:
        if self.layers.is_first:
            if not np.issubdtype(x.dtype, np.integer) or x.ndim != 1 or x.size == 0:
                raise StageError(f"stage {self.layers} expects int32 token ids (T,), got {x.dtype} {x.shape}")
            if x.min() < 0 or x.max() >= self.params.vocab:
                raise StageError(f"token ids must be in 0..{self.params.vocab - 1}, got {x.min()}..{x.max()}")
            return x.astype(np.intp, copy=False)
        # A stage of head rows only takes the normed rows and the logits of the rows before its own.
        before = self.layers.head.start if not self.blocks and self.layers.head is not None else 0
        return check_hidden(x, self.params.hidden + before, self.layers)

    def _cache(self, session: str, start_pos: int, T: int) -> KVCache:
        """The session's cache, checked to continue at start_pos; position 0 starts afresh."""
        limit = self.info.context_length
        if start_pos < 0 or start_pos + T > limit:
            raise StageError(f"positions {start_pos}..{start_pos + T} exceed the context length {limit}")
        with self._lock:
            cache = self._sessions.get(session)
            if start_pos == 0:
                self._sessions.pop(session, None)
                while len(self._sessions) >= MAX_SESSIONS:
                    self._sessions.popitem(last=False)  # the least recently used
                p = self.params
                windows = p.window[self.layers.start : self.layers.end]
                cache = KVCache(windows, p.n_kv_heads, p.head_dim, limit)
                self._sessions[session] = cache
            elif cache is None:
                raise StageError(
                    f"session {session!r} holds no cache here (unknown or evicted): start it at position 0"
                )
            elif cache.length != start_pos:
                raise StageError(
                    f"session {session!r} holds positions 0..{cache.length}: "
                    f"the next forward must start at {cache.length}, not {start_pos}"
                )
            self._sessions.move_to_end(session)
            return cache


# ---------------------------------------------------------------- building


def compiled_refusal(p: ModelParams, layers: LayerRange, blocks: list[BlockWeights]) -> str | None:
    """Why the stage's blocks cannot take the compiled path, or None when they can."""
    if not blocks:
        return "the stage holds no blocks"
    if not all(all_packed(w) for w in blocks):
        return "not every block matrix is packed in a type with a kernel"
    return decode.supports(p, range(layers.start, layers.end))


def build(path: Path, name: str, layers: LayerRange, precision: str) -> TransformerStage:
    """Load blocks `layers` (and the embedding / head if first / last) in `precision`.

    The caller has checked that `layers` fit the model (workers.models.build does).
    """
    check_precision(precision)  # before the slow parse
    file = open_gguf(path)
    p = read_params(file)
    load = Loader(file, precision)
    blocks = [load_block(load, p, i) for i in range(layers.start, layers.end)]
    first, last = layers.is_first, layers.is_last(p.n_layers)
    whole = last and layers.head is None  # the whole head, or only some of its rows (layers.head)
    tied = "output.weight" not in file.tensors  # the head reuses the token embedding
    # The table is held only as a head, which reads all of it every token; a stage that only embeds
    # reads the rows it looks up from the file. A stage that does both uses the one held copy for both.
    embd = "token_embd.weight", p.vocab, p.hidden
    token_embd = load.table(*embd) if whole and tied else load.file_table(*embd) if first else None
    output_norm = head = None
    if last and blocks:  # the stage that runs the last layer applies the final norm
        output_norm = load.vector("output_norm.weight", p.hidden)
    if whole:
        head = token_embd.head if tied else load.table("output.weight", p.vocab, p.hidden).head
    elif last:
        rows = (layers.head.start, layers.head.end)
        head = load.table(embd[0] if tied else "output.weight", p.vocab, p.hidden, rows).head
    return TransformerStage(
        info=model_info(p, name),
        layers=layers,
        params=p,
        blocks=blocks,
        token_embd=token_embd if first else None,
        output_norm=output_norm,
        head=head,
        precision=load.precision_name(),
        n_params=load.n_params,
        n_packed=load.n_packed,
    )
