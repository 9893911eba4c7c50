"""Why a generation stopped is on its record, as /runs/{id} serves it: an end token, a stop string, the
budget or a cancel."""

from __future__ import annotations

import asyncio
from pathlib import Path

from coordinator.events import TokenGenerated
from tests.coordinator.conftest import Api
from tests.support.tiny_chat import PROMPT, write_tiny_chat

BUDGET = 6


async def generated(api: Api, **body) -> dict:
    """Generate from PROMPT greedily; the run as GET /runs/{id} serves it once it has ended."""
    run = await api.finished(await api.submit({"prompt": PROMPT, "temperature": 0, **body}))
    assert run["status"] == "ok", run
    return run


async def test_a_generation_that_spends_its_budget_is_stored_as_finished_for_length(api_factory, tiny_chat):
    api = await api_factory(str(tiny_chat), 1)
    run = await generated(api, max_new_tokens=BUDGET)
    assert run["finish_reason"] == "length" and len(run["tokens"]) == BUDGET


async def test_a_generation_ended_by_a_stop_string_is_stored_as_finished_for_stop(api_factory, tiny_chat):
    api = await api_factory(str(tiny_chat), 1)
    whole = await generated(api, max_new_tokens=BUDGET)
    # A character of the greedy text: the same run, given more room, stops where it first shows.
    stop = whole["text"][len(whole["text"]) // 2]
    cut = whole["text"].index(stop)
    run = await generated(api, max_new_tokens=2 * BUDGET, stop=[stop])
    assert run["finish_reason"] == "stop" and run["text"] == whole["text"][:cut]
    assert len(run["tokens"]) <= BUDGET < 2 * BUDGET


async def test_a_generation_ended_by_its_end_token_is_stored_as_finished_for_stop(
    api_factory, tiny_chat, tmp_path: Path
):
    api = await api_factory(str(tiny_chat), 1)
    tokens = (await generated(api, max_new_tokens=BUDGET))["tokens"]
    # The same model, but the end token is one it samples after others: the greedy run ends there.
    at = next(i for i, token in enumerate(tokens) if i > 0 and token not in tokens[:i])
    ending = tmp_path / "tiny-chat-ending.gguf"
    write_tiny_chat(ending, context_length=1024, eos_id=tokens[at])
    api = await api_factory(str(ending), 1)
    run = await generated(api, max_new_tokens=2 * BUDGET)
    assert run["finish_reason"] == "stop" and run["tokens"] == tokens[:at]


async def test_a_cancelled_generation_is_stored_as_finished_for_cancelled(api_factory, tiny_chat):
    api = await api_factory(str(tiny_chat), 1)
    with api.cluster.bus.subscribe(accept=lambda e: isinstance(e, TokenGenerated)) as made:
        run_id = await api.submit({"prompt": PROMPT, "max_new_tokens": 1000})
        async with asyncio.timeout(20):
            while (await made.get()).index < 2:
                pass
    async with api.session.delete(api.url(f"/runs/{run_id}")) as r:
        assert r.status == 200
    run = await api.finished(run_id)
    assert (run["status"], run["finish_reason"]) == ("cancelled", "cancelled") and len(run["tokens"]) < 1000


async def test_a_forward_of_activations_has_no_finish_reason(api):
    run = await api.finished(await api.submit({"seq": 2}))
    assert run["status"] == "ok" and run["finish_reason"] is None
