"""GET /openapi.json describes every route, from the Structs, and a live coordinator keeps to it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import aiohttp
import msgspec
import pytest
import pytest_asyncio
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from coordinator.api import create_app
from coordinator.api.openapi import COMPONENTS, REF, document
from coordinator.cluster import ClusterConfig
from coordinator.runs.requests import RunRequest
from tests.coordinator.runs.test_prompts import tiny_model  # noqa: F401  (a fixture)
from tests.support.serving import Serve

# schemathesis (~0.5 s of CPU to import) is imported by the tests that use it: every pytest process of a
# run collects this file, one runs it. Its pytest plugin is off (pyproject's addopts) for the same reason.
if TYPE_CHECKING:
    import schemathesis

TOKEN = "openapi-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Examples per operation and generation mode: enough to reach every documented answer of this small API.
EXAMPLES = 8
FUZZ_BOUND_S = 120
# A stream that ends only when its client leaves: a response that never ends cannot be checked.
STREAMS = {("GET", "/events")}
# The tests that share the served coordinator run in its event loop.
shared_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tiny_model):  # noqa: F811
    """A real `rlx-cluster serve` of a tiny language model on two stages, behind a token."""
    serve = await Serve.start(  # an even split: the layers' timing (a GGUF file's default) is not asked here
        "--model", str(tiny_model), "--stages", "2", "--plan", "even", "--db", ":memory:", "--token", TOKEN
    )
    try:
        await serve.said("serving on", 60)
        yield f"http://127.0.0.1:{serve.port}"
    finally:
        await serve.stop()


async def fetch(url: str, headers: dict[str, str] | None = None) -> tuple[int, object]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(url, headers=headers) as r,
    ):
        return r.status, await r.json()


def test_every_route_the_app_has_is_described_and_nothing_else():
    app = create_app(ClusterConfig("fake:layers=2", 1))
    routed = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    described = {(m.upper(), path) for path, ops in document(app)["paths"].items() for m in ops}
    assert described == routed


def test_bodies_are_described_by_the_schemas_msgspec_generates_from_their_structs():
    _, generated = msgspec.json.schema_components([RunRequest], ref_template=REF)
    assert COMPONENTS["RunRequest"] == generated["RunRequest"]
    assert COMPONENTS["RunRequest"]["properties"]["max_new_tokens"]["maximum"] == 4096


@shared_loop
async def test_the_document_needs_the_token_and_is_valid_openapi_3_1(served):
    status, body = await fetch(f"{served}/openapi.json")
    assert status == 401 and body == {"error": "missing or wrong bearer token"}
    status, doc = await fetch(f"{served}/openapi.json", AUTH)
    assert status == 200 and doc["openapi"] == "3.1.0"
    import schemathesis

    schema = schemathesis.openapi.from_dict(doc)
    schema.validate()  # against the OpenAPI 3.1 meta-schema
    described = {"/v1/chat/completions", "/v1/completions", "/events", "/metrics", "/runs/{id}/trace"}
    assert described <= set(doc["paths"])


@shared_loop
async def test_every_operation_said_to_need_the_token_answers_401_without_it(served):
    status, doc = await fetch(f"{served}/openapi.json", AUTH)
    assert status == 200
    asked = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for path, ops in doc["paths"].items():
            for method, op in ops.items():
                url = served + path.format(id=1, index=0, model="x", name="app.js")
                async with session.request(method, url) as r:
                    said = (await r.json())["error"] if r.status == 401 else None
                if op.get("security") == []:
                    assert r.status != 401, (method, path)
                else:
                    asked += 1
                    assert r.status == 401 and said is not None, (method, path, r.status)
                    assert str(401) in op["responses"], (method, path)
    assert asked >= 15


def fuzz(base: str) -> list[str]:
    """Every operation but the streams, positive and negative examples: what schemathesis finds wrong."""
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=AUTH, timeout=10)
    failures: list[str] = []
    with requests.Session() as session:
        for result in schema.get_all_operations():
            op = result.ok()
            if (op.method.upper(), op.path) in STREAMS:
                continue
            for mode in ("positive", "negative"):
                try:
                    _examples(op, mode, base, session)()
                except Unsatisfiable:  # nothing here can be made invalid: no parameters, no body
                    continue
                except Exception as exc:
                    failures.append(f"{op.method.upper()} {op.path} ({mode}): {exc}")
    return failures


def _examples(op: schemathesis.APIOperation, mode: str, base: str, session: requests.Session):
    """A hypothesis test sending `op`'s `mode` examples to `base` and checking each answer."""
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=base, session=session, headers=AUTH, checks=checks, timeout=60)

    return check


@shared_loop
async def test_no_operation_answers_a_server_error_or_breaks_its_schema(served):
    failures = await asyncio.wait_for(asyncio.to_thread(fuzz, served), FUZZ_BOUND_S)
    assert failures == [], "\n\n".join(failures)
