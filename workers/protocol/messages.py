"""The messages the coordinator and a worker exchange, each a msgpack header of one frame.

Every field is bounded (lengths, ranges, patterns), so a header that decodes is
one the receiver can hold; how the frames carry them is workers.protocol.wire.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np

from workers.protocol.report import LayerRange, NodeReport

PROTOCOL_VERSION = 1
# Tensors that may cross the wire, by numpy dtype name; nothing else decodes.
DTYPES = {"float32": np.float32, "float16": np.float16, "int32": np.int32}
MAX_DIMS = 4
# Sessions in one batched forward: far more than a scheduler keeps active, far fewer than a header holds.
MAX_BATCH = 256

RequestId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
SessionId = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
Position = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Mac = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Proof = Annotated[bytes, msgspec.Meta(max_length=32)]  # a Mac, or empty for none
Dim = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Rows = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
HostPort = Annotated[str, msgspec.Meta(min_length=3, max_length=300, pattern=r"^\S+:[0-9]{1,5}$")]
ModelSpec = Annotated[str, msgspec.Meta(max_length=4096)]
PrecisionName = Annotated[str, msgspec.Meta(max_length=64)]


class Tensor(msgspec.Struct, frozen=True):
    """Describes the payload that follows the header.

    dtype: a name from DTYPES.
    shape: dimensions, at most MAX_DIMS; their product times the item size
        must equal the payload length.
    """

    dtype: str
    shape: Annotated[list[Dim], msgspec.Meta(max_length=MAX_DIMS)]


class Challenge(msgspec.Struct, tag="challenge", frozen=True):
    """Worker → client, first frame on a connection.

    nonce: random bytes the client must MAC with the shared token.
    version: the worker's protocol version.
    """

    nonce: Nonce
    version: int = PROTOCOL_VERSION


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """Client → worker: the answer to a Challenge.

    mac: HMAC-SHA256(token, "client" + worker nonce).
    nonce: the client's own challenge for the worker.
    """

    mac: Mac
    nonce: Nonce


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    """Worker → client: the handshake succeeded.

    mac: HMAC-SHA256(token, "worker" + client nonce), so the worker proves
        it knows the token too.
    report: the worker's NodeReport.
    joined: for a worker serving the layers a join assigned it,
        HMAC-SHA256(the Assign's ticket, "joined" + client nonce): the proof
        that it is the worker that joined; empty for any other worker.
    """

    mac: Mac
    report: NodeReport
    joined: Proof = b""


class Forward(msgspec.Struct, tag="forward", frozen=True):
    """Client → worker: run this stage on the tensor in the payload.

    id: request id, echoed in the reply.
    session: the run this forward belongs to (keys the KV cache).
    start_pos: position of the first row of the input in the sequence.
    tensor: the input tensor's dtype and shape.
    last_only: the last stage returns only the last position's output.
    """

    id: RequestId
    session: SessionId
    start_pos: Position
    tensor: Tensor
    last_only: bool = False


class Result(msgspec.Struct, tag="result", frozen=True):
    """Worker → client: the output of a Forward, in the payload.

    id: the Forward's id.
    compute_ms: the worker's own time for the stage compute.
    tensor: the output tensor's dtype and shape.
    """

    id: RequestId
    compute_ms: float
    tensor: Tensor


class BatchEntry(msgspec.Struct, frozen=True):
    """One session's part of a ForwardBatch: the next `rows` rows of the payload.

    session: the run these rows belong to (keys the KV cache); once per batch.
    start_pos: position of the session's first row in its sequence.
    rows: how many consecutive rows of the payload are this session's.
    last_only: the last stage returns only this session's last position.
    """

    session: SessionId
    start_pos: Position
    rows: Rows
    last_only: bool = False


class ForwardBatch(msgspec.Struct, tag="forward_batch", frozen=True):
    """Client → worker: run this stage once on the rows of several sessions, stacked in the payload.

    id: request id, echoed in the reply.
    entries: each session's rows, in payload order; their rows add up to the tensor's first dimension.
    tensor: the stacked input's dtype and shape.
    """

    id: RequestId
    entries: Annotated[list[BatchEntry], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]
    tensor: Tensor


class BatchResult(msgspec.Struct, tag="batch_result", frozen=True):
    """Worker → client: the outputs of a ForwardBatch, stacked in the payload in entry order.

    id: the ForwardBatch's id.
    compute_ms: the worker's own time for the whole batch.
    rows: output rows of each entry, in order; they add up to the tensor's first dimension.
    tensor: the stacked output's dtype and shape.
    """

    id: RequestId
    compute_ms: float
    rows: Annotated[list[Rows], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]
    tensor: Tensor


class Reset(msgspec.Struct, tag="reset", frozen=True):
    """Client → worker: forget a session (free its KV cache).

    id: request id.
    session: the session to drop; unknown sessions are not an error.
    """

    id: RequestId
    session: SessionId


class Done(msgspec.Struct, tag="done", frozen=True):
    """Worker → client: a request with no data in reply has completed.

    id: the request's id.
    """

    id: RequestId


class GetStats(msgspec.Struct, tag="get_stats", frozen=True):
    """Client → worker: ask for live stats.

    id: request id.
    """

    id: RequestId


class Stats(msgspec.Struct, tag="stats", frozen=True):
    """Worker → client: live stats.

    id: the GetStats id.
    resident_bytes: resident set now.
    sessions: sessions holding a KV cache.
    forwards: forwards served since start.
    kv_bytes: the bytes the sessions' KV caches hold now, all sessions (part of resident_bytes).
    kv_session_bytes: the same by session (0 and empty from a worker older than these fields).
    """

    id: RequestId
    resident_bytes: int
    sessions: int
    forwards: int
    kv_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    kv_session_bytes: Annotated[
        dict[SessionId, Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_BATCH)
    ] = {}


class Error(msgspec.Struct, tag="error", frozen=True):
    """Either side: a request failed.

    id: the failed request's id (0 when no request is to blame).
    message: what went wrong, for a person.
    final: the sender will not take the peer, however often it tries again
        (a joiner told so stops rather than join again).
    """

    id: RequestId
    message: str
    final: bool = False


class Fingerprint(msgspec.Struct, frozen=True):
    """What identifies a model's weights without reading them all.

    kind: "gguf" for a model file, "spec" for a model made from its spec (synthetic, fake).
    name: the file's name, or the spec itself.
    size: the file's size in bytes (0 for a spec).
    head_sha256: hex SHA-256 of the file's first bytes, its header ("" for a spec).
    """

    kind: Literal["gguf", "spec"]
    name: Annotated[str, msgspec.Meta(max_length=1024)]
    size: Annotated[int, msgspec.Meta(ge=0)] = 0
    head_sha256: Annotated[str, msgspec.Meta(max_length=64)] = ""


class Admit(msgspec.Struct, tag="admit", frozen=True):
    """Coordinator → joiner: the joiner's Hello was right.

    A joiner answers the coordinator's Challenge with a Hello whose mac is
    HMAC-SHA256(token, "joiner" + nonce); roles differ from the client/worker
    handshake's, so no answer from one can be replayed in the other.

    mac: HMAC-SHA256(token, "coordinator" + the joiner's nonce).
    model: the model spec the coordinator runs, for a joiner started without
        one to resolve locally ("" from a coordinator older than this field).
    precision: the precision the coordinator's stages build in, for a joiner
        started without one ("": the model's default).
    """

    mac: Mac
    model: ModelSpec = ""
    precision: PrecisionName = ""


class Offer(msgspec.Struct, tag="offer", frozen=True):
    """Joiner → coordinator, once admitted: what the worker can hold and where it serves.

    addr: `host:port` at which the coordinator reaches the stage server the worker will run.
    model: the model spec the worker serves: its --model, or the one the coordinator told it.
    fingerprint: the model's fingerprint; the coordinator refuses one unlike its own.
    precision: the precision the worker builds its layers in.
    memory_bytes: memory the worker can use (MemAvailable, less under a cgroup limit).
    cores: CPU cores the worker may run on.
    pid: the worker's process id.
    layer_ms: each layer's decode ms as the worker measured it on its own host, in its precision and
        threads (workers.calibrate: a stage costs stage_ms plus its layers'); [] from a worker that
        did not measure (an older one), which is then placed without.
    stage_ms: what a decode step costs a stage beyond its layers, measured with layer_ms.
    calibration: how layer_ms was measured, for a person ("sampled", "full", "…, cached").
    probes: whether the worker echoes Probe frames while it waits (an older one does not).
    cpu_share: the cores its cgroup's CPU quota allows it (quota over period); 0 for no quota. Its
        layer_ms are what a step costs unthrottled: a quota holds its stage to that share of the time.
    """

    addr: HostPort
    model: ModelSpec
    fingerprint: Fingerprint
    precision: PrecisionName
    memory_bytes: Annotated[int, msgspec.Meta(ge=0)]
    cores: Annotated[int, msgspec.Meta(ge=1)]
    pid: Annotated[int, msgspec.Meta(ge=0)] = 0
    layer_ms: Annotated[list[Annotated[float, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=4096)] = []
    stage_ms: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    calibration: Annotated[str, msgspec.Meta(max_length=64)] = ""
    probes: bool = False
    cpu_share: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class Probe(msgspec.Struct, tag="probe", frozen=True):
    """Coordinator → joiner, and back unchanged: a frame of a forward's size that times the link.

    id: which probe this is; the joiner's echo carries the same.
    tensor: the payload's description (bytes of no meaning, a forward's activations' size).
    """

    id: Annotated[int, msgspec.Meta(ge=0)]
    tensor: Tensor


class Assign(msgspec.Struct, tag="assign", frozen=True):
    """Coordinator → joiner: build these layers, serve them, then send Built.

    layers: the contiguous range the worker is to hold.
    ticket: random bytes the worker proves it holds in the Welcome of the
        stage it serves (see Welcome.joined), so that the coordinator knows
        the worker at the address offered is this one ("" from an older coordinator).
    """

    layers: LayerRange
    ticket: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class Built(msgspec.Struct, tag="built", frozen=True):
    """Joiner → coordinator: the assigned layers are built and served.

    report: the worker's NodeReport; its addr is where the coordinator connects.
    """

    report: NodeReport


Message = (
    Challenge | Hello | Welcome | Forward | Result | ForwardBatch | BatchResult | Reset | Done | GetStats
    | Stats | Error | Admit | Offer | Assign | Built | Probe
)  # fmt: skip
