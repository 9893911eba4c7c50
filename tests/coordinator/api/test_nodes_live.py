"""GET /nodes?live=1 says how many bytes each stage's KV caches hold, in all and by session. Real workers."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.stages.chain import ForwardRequest
from tests.conftest import eventually
from tests.support.tiny_gguf import TINY_ARCHS, write_tiny_arch
from workers.protocol.info import BatchItem

GEMMA3 = TINY_ARCHS["gemma3"]  # six layers, window 4: layers 0-4 windowed, layer 5 global
PER_POSITION = 2 * GEMMA3.n_kv_heads * GEMMA3.head_dim * 4  # a key and a value of float32, one layer
# Two stages, layers 0..3 and 3..6. A windowed layer's ring holds its window; the global layer's
# cache starts at 64 positions (kvcache.MIN_CACHE), here the whole context.
STAGE_BYTES = [3 * 4 * PER_POSITION, (2 * 4 + 64) * PER_POSITION]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "gemma3.gguf"
    write_tiny_arch(path, GEMMA3, "q8_0")
    return str(path)


async def forward(api, session: str, start: int, n: int) -> None:
    tokens = np.arange(100 + start, 100 + start + n, dtype=np.int32)
    await api.cluster.pipeline.forward(ForwardRequest(BatchItem(tokens, session, start, True)))


async def live(api) -> list[dict]:
    status, body, _ = await api.get("/nodes?live=1")
    assert status == 200, body
    return [node["live"] for node in body["nodes"]]


async def test_live_nodes_say_the_bytes_their_sessions_kv_caches_hold(api_factory, tiny_gemma3):
    api = await api_factory(tiny_gemma3, 2, precision="f32")
    await eventually(lambda: api.cluster.pipeline.unready() is None, 30, "the stages to be up")
    assert [n["kv_bytes"] for n in await live(api)] == [0, 0]
    await forward(api, "a", 0, 10)  # a prompt longer than the window
    await forward(api, "a", 10, 20)
    await forward(api, "b", 0, 2)
    nodes = await live(api)
    assert [n["kv_session_bytes"] for n in nodes] == [{"a": b, "b": b} for b in STAGE_BYTES]
    assert [n["kv_bytes"] for n in nodes] == [2 * b for b in STAGE_BYTES]
    await api.cluster.pipeline.reset("a")
    nodes = await live(api)
    assert [(n["kv_bytes"], n["kv_session_bytes"]) for n in nodes] == [(b, {"b": b}) for b in STAGE_BYTES]
