"""docker-compose.yml run as written, one network namespace per replica: join, runs, refusals, a rejoin.

Images cannot be pulled where this project is built, so this is what proves the
compose file: each service's command and environment, started with the
project's entry points on hosts that reach each other only over a private
bridge, and an HTTP client on a host of its own. The tests share one
deployment, started once for the module.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import signal
import time

import pytest

from coordinator.cli.main import default_question
from coordinator.cluster import model_tokenizer
from tests.hosts.compose import healthcheck
from tests.hosts.conftest import Deployment
from tests.hosts.netns import wait_until

pytestmark = pytest.mark.timeout(600)

WORKERS = ("worker-1", "worker-2", "worker-3")
READY_TIMEOUT = 240.0  # three SmolLM2 or Gemma 3 stages built at once on two cores
RUN_TIMEOUT = 120.0
REFUSAL_TIMEOUT = 30.0
FAIL_WITHIN_S = 2.0
# The model is the compose file's (RLX_MODEL, or its default): see the deployment fixture.
LONG_TOKENS = 64  # still generating when a worker is killed, a few tokens in


@functools.cache
def chats(model: str) -> bool:
    """Whether the model's file has a chat template: SmolLM2's has; Gemma 3 270M's (a base model) has none."""
    return model_tokenizer(model).chat_template is not None


def model_of(dep: Deployment) -> str:
    """The model the coordinator runs, and so every worker (they are started without --model)."""
    return dep.services["coordinator"].option("--model")


def capital(dep: Deployment) -> dict:
    """The question as the model takes it: a chat turn, or a text to complete."""
    return {**default_question(chats(model_of(dep))), "max_new_tokens": 24}


def long_run(dep: Deployment) -> dict:
    """A run still generating when a worker is killed, as the model takes it."""
    if chats(model_of(dep)):
        return {
            "prompt": "Write a long story about a lighthouse keeper.",
            "chat": True,
            "max_new_tokens": LONG_TOKENS,
        }
    return {
        "prompt": "The lighthouse keeper's long story began on a stormy night, when",
        "max_new_tokens": LONG_TOKENS,
    }


def host_of(addr: str) -> str:
    return addr.rpartition(":")[0].strip("[]")


def stages(dep: Deployment) -> list[dict]:
    status, body = dep.get("/nodes")
    assert status == 200, body
    return body["nodes"]


def ask_capital(dep: Deployment) -> dict:
    status, body = dep.request("POST", "/runs", capital(dep))
    assert status == 202, body
    run = dep.finished(body["id"], RUN_TIMEOUT)
    assert run["status"] == "ok", run
    return run


def measured(name: str, value: float) -> None:
    """Print one measurement for the closing note (shown with `make hosts`)."""
    print(f"\nmeasured {name}: {value:.3f}")


@pytest.fixture(scope="module")
def running(deployment: Deployment) -> Deployment:
    """Start every replica of every service, in compose's order, and wait until the cluster is ready."""
    for service in deployment.services.values():
        for replica in service.replica_names():
            deployment.start(replica)
    health = deployment.ready(READY_TIMEOUT)
    measured("serve_to_ready_s", time.monotonic() - deployment.started_at["coordinator"])
    assert health["ok"] is True, health
    return deployment


def test_the_three_workers_join_and_the_coordinator_is_ready_at_their_namespace_addresses(running):
    dep = running
    nodes = stages(dep)
    assert [n["state"] for n in nodes] == ["up"] * 3, nodes
    assert sorted(host_of(n["addr"]) for n in nodes) == sorted(dep.addr(w) for w in WORKERS)
    layers = [(n["layers"]["start"], n["layers"]["end"]) for n in nodes]
    assert layers[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(layers)), layers


def test_the_images_health_check_passes_on_the_coordinators_host(running):
    code, out, err = running.net.run(running.host("coordinator"), healthcheck(), running.base_env, 30)
    assert code == 0, (out, err)


def test_a_run_from_the_client_host_answers_paris_and_times_every_stage(running):
    run = ask_capital(running)
    assert "Paris" in run["text"], run["text"]

    status, latest = running.get("/run/latest")
    assert status == 200 and latest["id"] == run["id"]
    for step in (latest, latest["decode"]):
        timings = step["timings"]
        assert [t["stage"] for t in timings] == [0, 1, 2]
        assert {host_of(t["addr"]) for t in timings} == {running.addr(w) for w in WORKERS}
        assert all(t["forward_ms"] >= t["compute_ms"] > 0 for t in timings), timings
    hops = [t["forward_ms"] - t["compute_ms"] for t in latest["decode"]["timings"]]
    measured("decode_hop_overhead_ms_per_token", sum(hops) / len(hops) / latest["decode"]["seq"])


@pytest.mark.parametrize("token", [None, "not-the-worker-token"], ids=["no-token", "wrong-token"])
def test_a_worker_without_the_right_token_is_refused_and_never_gets_layers(running, token):
    dep = running
    env = {k: v for k, v in dep.services["worker"].env(dep.mounts).items() if k != "RLX_WORKER_TOKEN"}
    if token is not None:
        env["RLX_WORKER_TOKEN"] = token
    log = dep.log("stranger")
    log.unlink(missing_ok=True)
    proc = dep.start("worker-1", env=env, host="stranger")

    wait_until(
        lambda: proc.poll() is not None,
        REFUSAL_TIMEOUT,
        "the stranger to give up",
        lambda: dep.tail("stranger"),
    )
    said = log.read_text()
    assert proc.returncode != 0, said
    assert "refused" in said, said
    if token is None:  # the operator is told what is missing, not only that it failed
        assert "RLX_WORKER_TOKEN is not set" in said, said
    assert "building layers" not in said and '"layers"' not in said, said
    # It did reach the coordinator, which turned it away (not, say, a name that did not resolve);
    # the coordinator may log that a moment after the stranger has heard it.
    wait_until(
        lambda: dep.addr("stranger") in dep.log("coordinator").read_text(),
        REFUSAL_TIMEOUT,
        "the coordinator to log the refusal",
        lambda: dep.tail("coordinator"),
    )
    assert dep.addr("stranger") not in json.dumps(dep.get("/nodes")[1])
    assert dep.get("/healthz")[0] == 200


def test_a_killed_worker_is_replaced_by_its_replica_and_the_run_in_flight_goes_on_in_its_stage(running):
    dep = running
    victim = "worker-2"
    before = next(n for n in stages(dep) if host_of(n["addr"]) == dep.addr(victim))
    status, body = dep.request("POST", "/runs", long_run(dep))
    assert status == 202, body

    def generating():
        status, run = dep.get(f"/runs/{body['id']}")
        return status == 200 and run["status"] == "running" and len(run.get("tokens") or []) >= 3

    wait_until(generating, RUN_TIMEOUT, "the long run to be generating", lambda: dep.tail())
    os.kill(dep.procs[victim].pid, signal.SIGKILL)
    killed_mono = time.monotonic()

    def vacant():
        node = next(n for n in stages(dep) if n["stage"] == before["stage"])
        return node["state"] in ("down", "vacant")

    # The run waits for its stage (the recover timeout, 30 s by default) rather than failing at once.
    wait_until(vacant, FAIL_WITHIN_S * 5, "the killed worker's stage to be vacant", lambda: dep.tail())
    assert dep.get(f"/runs/{body['id']}")[1]["status"] == "running"
    dep.start(victim)
    run = dep.finished(body["id"], READY_TIMEOUT)
    measured("sigkill_to_run_finished_s", time.monotonic() - killed_mono)
    assert run["status"] == "ok", run
    [recovery] = run["recoveries"]
    assert recovery["stage"] == before["stage"] and recovery["addr"] == before["addr"], recovery
    assert host_of(recovery["new_addr"]) == dep.addr(victim), recovery
    after = next(n for n in stages(dep) if n["stage"] == before["stage"])
    assert after["state"] == "up" and after["layers"] == before["layers"], after
    assert "Paris" in ask_capital(dep)["text"]


def test_another_host_is_refused_the_api_without_the_bearer_token(running):
    dep = running
    for path in ("/nodes", "/run/latest", "/runs"):
        assert dep.get(path, token=None)[0] == 401, path
        assert dep.get(path, token="not-the-api-token")[0] == 401, path
    assert dep.request("POST", "/runs", capital(dep), token=None)[0] == 401
    assert dep.get("/nodes")[0] == 200
