"""A llama-architecture GGUF model as pipeline stages, computed in numpy.

A block is two residual lines: x + attention(rms_norm(x)), then
x + swiglu(rms_norm(x)). Stage 0 embeds token ids, the last stage applies the
final norm and the head; every block's math is the same wherever it runs, so
any split of the blocks computes bitwise the same logits as one stage, given
the same BLAS with the same thread count (OpenBLAS's results change with
OPENBLAS_NUM_THREADS, in the last bits). A stage whose blocks are all packed
computes a few rows (decode steps, short prompts) in compiled code instead
(workers.models.decode), the same on every stage and thread count.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workers.models import decode, kernels
from workers.models.dense import product
from workers.models.gguf_file import LlamaParams, open_gguf
from workers.models.kernels import PackedMatrix
from workers.models.layout import check_precision
from workers.models.ops import rms_norm, silu
from workers.models.weights import Loader, Matrix, TokenTable
from workers.protocol.info import BatchItem, ModelInfo
from workers.protocol.report import LayerRange
from workers.stage import StageError, check_hidden

MAX_SESSIONS = 8
MIN_CACHE = 64  # positions a new session's KV cache starts with; it doubles as needed


def describe(path: Path, name: str) -> ModelInfo:
    """Read the model's shape from the file's metadata, without loading tensors."""
    return model_info(open_gguf(path).llama_params(), name)


def model_info(p: LlamaParams, name: str) -> ModelInfo:
    """What the coordinator needs of a llama model with hyper-parameters `p`."""
    return ModelInfo(
        name=name,
        n_layers=p.n_layers,
        input="tokens",
        hidden=p.hidden,
        vocab=p.vocab,
        context_length=p.context_length,
        max_sessions=MAX_SESSIONS,
    )


# ---------------------------------------------------------------- the math


def rope_tables(positions: np.ndarray, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of each position's rotation angles, each (T, 1, head_dim/2)."""
    inv_freq = base ** (-np.arange(0, head_dim, 2) / head_dim)  # (hd/2,)
    angles = positions[:, None] * inv_freq[None, :]  # (T, hd/2), in float64
    return (
        np.cos(angles).astype(np.float32)[:, None, :],
        np.sin(angles).astype(np.float32)[:, None, :],
    )


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of each head of x (T, H, hd).

    GGUF llama files store Q and K rows permuted so that this pairing (ggml's
    "normal" RoPE) matches the original model's rotate-half convention.
    """
    even, odd = x[..., 0::2], x[..., 1::2]  # (T, H, hd/2) each
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def causal_mask(T: int, start_pos: int) -> np.ndarray | None:
    """Additive mask (T, start_pos + T): row i sees keys up to position start_pos + i."""
    if T == 1:
        return None  # one new row sees every cached key
    return np.triu(np.full((T, start_pos + T), -np.inf, dtype=np.float32), k=start_pos + 1)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax along the last axis, in place on a fresh array."""
    x = x - x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """Causal grouped-query attention of q (T, H, hd) over keys, values (KV, L, hd); (T, H·hd) out.

    Query head h reads KV head h // (H / KV). Rather than repeating K and V
    (repeat_kv), the query heads of a group are stacked as extra rows.
    """
    T, H, hd = q.shape
    n_kv, L = keys.shape[0], keys.shape[1]
    group = H // n_kv
    q = q * np.float32(1.0 / np.sqrt(hd))
    q = q.reshape(T, n_kv, group, hd).transpose(1, 2, 0, 3).reshape(n_kv, group * T, hd)  # (KV, G·T, hd)
    scores = (q @ keys.transpose(0, 2, 1)).reshape(n_kv, group, T, L)  # (KV, G, T, L)
    if mask is not None:
        scores += mask
    probs = softmax(scores).reshape(n_kv, group * T, L)  # (KV, G·T, L)
    out = (probs @ values).reshape(n_kv, group, T, hd)  # (KV, G, T, hd)
    return out.transpose(2, 0, 1, 3).reshape(T, H * hd)  # (T, H·hd)


def swiglu(x: np.ndarray, ffn_gate: Matrix, ffn_up: Matrix) -> np.ndarray:
    """The gated feed-forward's hidden layer: silu(x W_gate) ⊙ (x W_up)."""
    return silu(x @ ffn_gate) * (x @ ffn_up)


# ---------------------------------------------------------------- weights and cache


@dataclass(frozen=True)
class BlockWeights:
    """One transformer block's tensors, named as in the checkpoint (`blk.N.<name>.weight`)."""

    attn_norm: np.ndarray
    attn_q: Matrix
    attn_k: Matrix
    attn_v: Matrix
    attn_output: Matrix
    ffn_norm: np.ndarray
    ffn_gate: Matrix
    ffn_up: Matrix
    ffn_down: Matrix

    @classmethod
    def load(cls, load: Loader, i: int, p: LlamaParams) -> BlockWeights:
        """Read block i's tensors, checking their shapes against the hyper-parameters."""
        n = f"blk.{i}."
        q_dim, kv_dim = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim
        return cls(
            attn_norm=load.vector(n + "attn_norm.weight", p.hidden),
            attn_q=load.matrix(n + "attn_q.weight", q_dim, p.hidden),
            attn_k=load.matrix(n + "attn_k.weight", kv_dim, p.hidden),
            attn_v=load.matrix(n + "attn_v.weight", kv_dim, p.hidden),
            attn_output=load.matrix(n + "attn_output.weight", p.hidden, q_dim),
            ffn_norm=load.vector(n + "ffn_norm.weight", p.hidden),
            ffn_gate=load.matrix(n + "ffn_gate.weight", p.ffn, p.hidden),
            ffn_up=load.matrix(n + "ffn_up.weight", p.ffn, p.hidden),
            ffn_down=load.matrix(n + "ffn_down.weight", p.hidden, p.ffn),
        )

    def packed(self) -> bool:
        """Whether every matrix is kept in blocks with a kernel, as workers.models.decode computes them."""
        return all(isinstance(getattr(self, name), PackedMatrix) for name in decode.MATRICES)


class KVCache:
    """One session's keys and values for a stage's blocks, grown by doubling."""

    def __init__(self, n_blocks: int, n_kv: int, head_dim: int, limit: int) -> None:
        self.length = 0
        self.limit = limit
        self.k = np.empty((n_blocks, n_kv, 0, head_dim), dtype=np.float32)  # (B, KV, capacity, hd)
        self.v = np.empty_like(self.k)

    def reserve(self, n: int) -> None:
        """Make room for n positions, keeping the ones held."""
        capacity = self.k.shape[2]
        if n <= capacity:
            return
        capacity = max(MIN_CACHE, capacity)
        while capacity < n:
            capacity *= 2
        capacity = min(capacity, self.limit)  # callers keep n within the limit
        shape = (*self.k.shape[:2], capacity, self.k.shape[3])
        k, v = np.empty(shape, dtype=np.float32), np.empty(shape, dtype=np.float32)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def extend(
        self, block: int, start_pos: int, k: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v (T, KV, hd) at start_pos.. for `block`; all keys, values (KV, L, hd) so far."""
        end = start_pos + k.shape[0]
        self.k[block, :, start_pos:end] = k.transpose(1, 0, 2)  # (KV, T, hd)
        self.v[block, :, start_pos:end] = v.transpose(1, 0, 2)
        return self.k[block, :, :end], self.v[block, :, :end]


def block(
    x: np.ndarray,
    w: BlockWeights,
    p: LlamaParams,
    cache: KVCache,
    index: int,
    start_pos: int,
    rope: tuple[np.ndarray, np.ndarray],
    mask: np.ndarray | None,
) -> np.ndarray:
    """One transformer block on x (T, hidden) at positions start_pos.."""
    T = x.shape[0]
    eps = np.float32(p.eps)
    h = rms_norm(x, w.attn_norm, eps)
    q = (h @ w.attn_q).reshape(T, p.n_heads, p.head_dim)  # (T, H, hd)
    k = (h @ w.attn_k).reshape(T, p.n_kv_heads, p.head_dim)  # (T, KV, hd)
    v = (h @ w.attn_v).reshape(T, p.n_kv_heads, p.head_dim)  # (T, KV, hd)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    keys, values = cache.extend(index, start_pos, k, v)
    x = x + attention(q, keys, values, mask) @ w.attn_output
    x = x + swiglu(rms_norm(x, w.ffn_norm, eps), w.ffn_gate, w.ffn_up) @ w.ffn_down
    return x


def decode_block(
    x: np.ndarray,
    w: BlockWeights,
    p: LlamaParams,
    caches: list[KVCache],
    index: int,
    positions: np.ndarray,
    rope: tuple[np.ndarray, np.ndarray],
) -> np.ndarray:
    """One transformer block on one new row per session: x (B, hidden), row b at positions[b] of caches[b].

    The matmuls take every row at once; attention is each session's own, over its cache.
    """
    B = x.shape[0]
    eps = np.float32(p.eps)
    h = rms_norm(x, w.attn_norm, eps)
    q = product(h, w.attn_q).reshape(B, p.n_heads, p.head_dim)  # (B, H, hd)
    k = product(h, w.attn_k).reshape(B, p.n_kv_heads, p.head_dim)  # (B, KV, hd)
    v = product(h, w.attn_v).reshape(B, p.n_kv_heads, p.head_dim)  # (B, KV, hd)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    rows = [
        attention(q[b : b + 1], *cache.extend(index, int(pos), k[b : b + 1], v[b : b + 1]), None)
        for b, (cache, pos) in enumerate(zip(caches, positions, strict=True))
    ]
    x = x + product(np.concatenate(rows), w.attn_output)  # rows: (1, H·hd) each
    h = rms_norm(x, w.ffn_norm, eps)
    return x + product(silu(product(h, w.ffn_gate)) * product(h, w.ffn_up), w.ffn_down)


# ---------------------------------------------------------------- the stage


class LlamaStage:
    """Blocks `layers` of a llama model, with per-session KV caches."""

    def __init__(
        self,
        info: ModelInfo,
        layers: LayerRange,
        params: LlamaParams,
        blocks: list[BlockWeights],
        token_embd: TokenTable | None,
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
        # A few rows through packed blocks take the compiled path (workers.models.decode): empty if not.
        packed = bool(blocks) and all(w.packed() for w in blocks)
        self._compiled_blocks = decode.stack(blocks) if packed else None
        self._cache_lists = decode.cache_lists() if packed else None  # a forward at a time uses them
        self._sessions: OrderedDict[str, KVCache] = OrderedDict()
        # forward and reset run on the server's compute thread, while a stats
        # request calls n_sessions() from the event loop, in the middle of them.
        self._lock = threading.Lock()

    def forward(self, x: np.ndarray, *, session: str, start_pos: int, last_only: bool) -> np.ndarray:
        """Run the blocks on x at positions start_pos..; logits (T or 1, vocab) on the last stage."""
        p = self.params
        x = self._check_input(x)
        T = x.shape[0]
        cache = self._cache(session, start_pos, T)
        cache.reserve(start_pos + T)
        rope = rope_tables(np.arange(start_pos, start_pos + T), p.head_dim, p.rope_base)
        h = self.token_embd.embed(x) if self.layers.is_first else x
        if self.compiled and T <= kernels.KERNEL_MAX_ROWS:
            h = self._compiled(h, [(cache, start_pos, 0, T)], rope)
        else:
            mask = causal_mask(T, start_pos)
            for index, w in enumerate(self.blocks):
                h = block(h, w, p, cache, index, start_pos, rope, mask)
        cache.length = start_pos + T  # only once every block holds the new positions
        if not self.layers.is_last(self.info.n_layers):
            return h
        if last_only:
            h = h[-1:]
        return rms_norm(h, self.output_norm, np.float32(p.eps)) @ self.head

    def forward_batch(self, items: list[BatchItem]) -> list[np.ndarray]:
        """Run one decode row per session (distinct sessions) as one batch; other batches item by item.

        Every item is checked, and its session's cache found, before anything is computed, so a
        refused batch leaves every cache as it was.
        """
        distinct = len({item.session for item in items}) == len(items)
        if len(items) < 2 or not distinct or any(item.x.shape[:1] != (1,) for item in items):
            return [self.forward(x, session=s, start_pos=pos, last_only=lo) for x, s, pos, lo in items]
        p = self.params
        xs = [self._check_input(item.x) for item in items]
        caches = [self._cache(item.session, item.start_pos, 1) for item in items]
        for cache, item in zip(caches, items, strict=True):
            cache.reserve(item.start_pos + 1)
        positions = np.array([item.start_pos for item in items])
        rope = rope_tables(positions, p.head_dim, p.rope_base)  # row b rotated at its own position
        h = np.concatenate(xs)  # (B,) token ids or (B, hidden)
        h = self.token_embd.embed(h) if self.layers.is_first else h
        if self.compiled:
            runs = [
                (cache, item.start_pos, b, b + 1)
                for b, (cache, item) in enumerate(zip(caches, items, strict=True))
            ]
            h = self._compiled(h, runs, rope)
        else:
            for index, w in enumerate(self.blocks):
                h = decode_block(h, w, p, caches, index, positions, rope)
        for cache, item in zip(caches, items, strict=True):
            cache.length = item.start_pos + 1
        if self.layers.is_last(self.info.n_layers):
            h = product(rms_norm(h, self.output_norm, np.float32(p.eps)), self.head)  # (B, vocab)
        return [h[b : b + 1] for b in range(len(items))]

    @property
    def compiled(self) -> bool:
        """Whether a few rows take the compiled path (every block's matrices packed with a kernel)."""
        return self._compiled_blocks is not None

    def _compiled(self, h: np.ndarray, runs: list, rope: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """The blocks on rows h through workers.models.decode; runs as decode.blocks takes them."""
        p = self.params
        # Rows from the wire are read-only: copied (a few KB), as compiled code takes them writable.
        h = np.array(h, dtype=np.float32, order="C", copy=True if not h.flags.writeable else None)
        cos, sin = (np.ascontiguousarray(a[:, 0]) for a in rope)  # (T, hd/2)
        return decode.blocks(h, self._compiled_blocks, p, runs, cos, sin, self._cache_lists)

    def reset(self, session: str) -> None:
        """Free the KV cache of `session`, if held."""
        with self._lock:
            self._sessions.pop(session, None)

    def n_sessions(self) -> int:
        """Sessions currently holding a KV cache."""
        with self._lock:
            return len(self._sessions)

    def _check_input(self, x: np.ndarray) -> np.ndarray:
        if self.layers.is_first:
            if not np.issubdtype(x.dtype, np.integer) or x.ndim != 1 or x.size == 0:
                raise StageError(f"stage {self.layers} expects int32 token ids (T,), got {x.dtype} {x.shape}")
            if x.min() < 0 or x.max() >= self.params.vocab:
                raise StageError(f"token ids must be in 0..{self.params.vocab - 1}, got {x.min()}..{x.max()}")
            return x.astype(np.intp, copy=False)
        return check_hidden(x, self.params.hidden, self.layers)

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
                cache = KVCache(len(self.blocks), p.n_kv_heads, p.head_dim, limit)
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


def build(path: Path, name: str, layers: LayerRange, precision: str) -> LlamaStage:
    """Load blocks `layers` (and the embedding / head if first / last) in `precision`.

    The caller has checked that `layers` fit the model (workers.models.build does).
    """
    check_precision(precision)  # before the slow parse
    file = open_gguf(path)
    p = file.llama_params()
    load = Loader(file, precision)
    blocks = [BlockWeights.load(load, i, p) for i in range(layers.start, layers.end)]
    first, last = layers.is_first, layers.is_last(p.n_layers)
    tied = "output.weight" not in file.tensors  # the head reuses the token embedding
    token_embd = load.table("token_embd.weight", p.vocab, p.hidden) if first or (last and tied) else None
    output_norm = head = None
    if last:
        output_norm = load.vector("output_norm.weight", p.hidden)
        head = token_embd.head if tied else load.table("output.weight", p.vocab, p.hidden).head
    return LlamaStage(
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
