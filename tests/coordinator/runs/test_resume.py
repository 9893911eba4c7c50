"""A coordinator SIGKILLed with runs accepted: the next one on the same --db finishes them, or says why not.

Real coordinator processes and real workers: fake ones where only the run's
fate matters, a tiny llama (and SmolLM2, packed) where the tokens must be those
of a run nobody disturbed.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import aiohttp
import pytest

from coordinator.runs.progress import PROGRESS_EVERY_S
from coordinator.store.history import INTERRUPTED_ERROR
from tests.conftest import eventually
from tests.support.serving import Serve
from tests.support.store_files import stored
from tests.support.tiny_chat import PROMPT, write_tiny_chatml

# Every forward of the fake model takes this long: a run is still running when its coordinator is killed.
SLOW = "fake:layers=2,delay_ms=1500"
# Seconds a coordinator has to serve, a run to finish, on a machine shared with others.
SERVE_S, RUN_S = 60, 60
# Progress is written every PROGRESS_EVERY_S; this bounds the wait for a write on a busy machine.
WRITTEN_S = 20 * PROGRESS_EVERY_S + 10


async def start(db: Path, model: str, *more: str) -> Serve:
    serve = await Serve.start("--model", model, "--stages", "1", "--plan", "even", "--db", str(db), *more)
    await serve.said("serving on", SERVE_S)
    return serve


async def killed(serve: Serve) -> None:
    serve.proc.send_signal(signal.SIGKILL)
    assert await serve.exit_code() == -signal.SIGKILL


async def one_running_one_queued(serve: Serve, db: Path) -> tuple[int, int]:
    """Two runs on a coordinator that runs one at a time: the first running, the second queued."""
    first, second = await serve.cluster.aio.post_run(seq=2), await serve.cluster.aio.post_run(seq=2)
    await eventually(lambda: stored(db, first)[0] == "running", RUN_S, f"run {first} to start")
    assert stored(db, second)[0] == "queued"
    return first, second


async def test_a_killed_coordinators_runs_are_resumed_by_default_interrupted_with_no_resume_or_another_model(
    tmp_path: Path,
) -> None:
    db = tmp_path / "runs.sqlite3"
    one = ("--max-active", "1")
    serves: list[Serve] = []
    try:
        serves.append(first := await start(db, SLOW, *one))
        done = await first.cluster.aio.post_run(seq=2)
        await first.cluster.aio.wait(done, "ok", RUN_S)
        kept = stored(db, done)
        running, queued = await one_running_one_queued(first, db)
        await killed(first)

        # The same model and plan: both go on, in the order they were accepted, saying so.
        serves.append(second := await start(db, SLOW, *one))
        for run_id, was in ((running, "running"), (queued, "queued")):
            run = await second.cluster.aio.wait(run_id, "ok", RUN_S)
            [resumed] = run["resumed"]
            assert (resumed["status"], resumed["tokens"]) == (was, 0) and resumed["at"] > kept[1][
                "finished_at"
            ]
        assert stored(db, done) == kept, "a run stored before the restart changed"

        # --no-resume: marked interrupted, as before resuming existed.
        late = await one_running_one_queued(second, db)
        await killed(second)
        serves.append(third := await start(db, SLOW, *one, "--no-resume"))
        for run_id in late:
            assert (await third.cluster.aio.wait(run_id, "interrupted", RUN_S))["error"] == INTERRUPTED_ERROR

        # Another model: marked interrupted, saying which models, never run on the other one.
        other = await one_running_one_queued(third, db)
        await killed(third)
        serves.append(fourth := await start(db, "fake:layers=2", *one))
        why = f"; not resumed: it ran model {SLOW}, and this coordinator runs fake:layers=2"
        for run_id in other:
            run = await fourth.cluster.aio.wait(run_id, "interrupted", RUN_S)
            assert run["error"] == INTERRUPTED_ERROR + why and run["resumed"] == []
        listed = {r["id"]: r["status"] for r in (await fourth.get("/runs"))[1]["runs"]}
        want = {done: "ok", running: "ok", queued: "ok"} | dict.fromkeys([*late, *other], "interrupted")
        assert listed == want
        assert stored(db, done) == kept
    finally:
        for serve in serves:
            await serve.stop()


@pytest.fixture(scope="module")
def tiny_chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny chat llama that never ends a generation by itself, with room for long ones."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-chatml.gguf"
    write_tiny_chatml(path, context_length=1024)
    return path


async def stored_tokens(db: Path, run_id: int) -> int:
    return len(stored(db, run_id)[1].get("tokens", []))


async def killed_mid_generation(serve: Serve, db: Path, run_id: int, at: int) -> int:
    """Freeze the run's stage once it has `at` tokens, let their write land, SIGKILL the coordinator.

    The tokens the store holds for it then, which the next coordinator goes on from.
    """

    async def generated() -> bool:
        return len((await serve.cluster.aio.run(run_id)).get("tokens", [])) >= at

    await eventually(generated, RUN_S, f"run {run_id} to generate {at} tokens")
    await serve.cluster.aio.pause_stage(0)  # the generation stops where it is (a reply on its way lands)
    live: list[int] = []

    async def all_written() -> bool:
        live[:] = (await serve.cluster.aio.run(run_id))["tokens"]
        return await stored_tokens(db, run_id) == len(live)

    await eventually(all_written, WRITTEN_S, "the tokens generated to be written")
    await killed(serve)
    return len(live)


async def test_a_streamed_chat_whose_coordinator_is_killed_errors_then_ends_with_an_undisturbed_runs_tokens(
    tiny_chatml: Path, tmp_path: Path
) -> None:
    db, model, budget = tmp_path / "runs.sqlite3", str(tiny_chatml), 160
    serves: list[Serve] = []
    try:
        serves.append(first := await start(db, model))
        body = {
            "model": (await first.get("/v1/models"))[1]["data"][0]["id"],
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": budget, "stream": True,
            "temperature": 0,
        }  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=RUN_S)
        async with (
            aiohttp.ClientSession(first.cluster.base_url, timeout=timeout) as session,
            session.post("/v1/chat/completions", json=body) as stream,
        ):
            assert stream.status == 200
            run_id = (await first.get("/runs"))[1]["runs"][0]["id"]
            written = await killed_mid_generation(first, db, run_id, 10)
            with pytest.raises(aiohttp.ClientError):  # its server is gone: the stream cannot end well
                async for raw in stream.content:
                    assert b"[DONE]" not in raw
        serves.append(second := await start(db, model))
        resumed = await second.cluster.aio.wait(run_id, "ok", RUN_S)
        assert resumed["resumed"][0]["tokens"] == written and 10 <= written < budget
        fresh = await second.post("/v1/chat/completions", {**body, "stream": False})
        assert fresh[0] == 200, fresh
        undisturbed = await second.cluster.aio.wait((await second.get("/runs"))[1]["runs"][0]["id"], "ok")
        assert len(undisturbed["tokens"]) == budget and resumed["finish_reason"] == "length"
        assert resumed["tokens"] == undisturbed["tokens"] and resumed["text"] == undisturbed["text"]
    finally:
        for serve in serves:
            await serve.stop()


async def test_smollm2_killed_at_token_10_and_restarted_ends_with_the_tokens_of_an_undisturbed_run(
    tmp_path: Path,
) -> None:
    db, budget = tmp_path / "runs.sqlite3", 24
    request = {"prompt": "The capital of France is", "max_new_tokens": budget, "temperature": 0}
    serves: list[Serve] = []
    try:
        serves.append(first := await start(db, "smollm2", "--precision", "packed"))
        run_id = await first.cluster.aio.post_run(**request)
        written = await killed_mid_generation(first, db, run_id, 10)
        serves.append(second := await start(db, "smollm2", "--precision", "packed"))
        resumed = await second.cluster.aio.wait(run_id, "ok", RUN_S)
        undisturbed = await second.cluster.aio.wait(await second.cluster.aio.post_run(**request), "ok", RUN_S)
        assert resumed["resumed"][0]["tokens"] == written and 10 <= written < budget
        assert resumed["tokens"] == undisturbed["tokens"] and resumed["text"] == undisturbed["text"]
        assert json.dumps(resumed["finish_reason"]) == json.dumps(undisturbed["finish_reason"])
    finally:
        for serve in serves:
            await serve.stop()
