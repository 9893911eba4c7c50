"""GET /openapi.json: the HTTP surface in OpenAPI 3.1, its schemas generated from the msgspec Structs.

Every operation is described once, in OPERATIONS; the document lists those the
app really routes (a face not set up is left out), and a test checks that every
route the app has is described. Bodies are the Structs that encode or decode
them (msgspec.json.schema_components), answers built as dicts the Structs of
api/schemas.py. Behind the bearer token like every data endpoint.
"""

from __future__ import annotations

import functools
from importlib.metadata import version

import msgspec
from aiohttp import web

from coordinator.api import schemas
from coordinator.api.common import OpenAIError, json_response
from coordinator.api.openai_shapes import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    Model,
    ModelList,
    TextCompletion,
    TextCompletionChunk,
)
from coordinator.api.runs import DEFAULT_LIMIT, MAX_LIMIT
from coordinator.events import KINDS, AnyEvent
from coordinator.runs.requests import RunRequest
from coordinator.stats import ReduceKind
from workers.protocol.report import NodeReport

REF = "#/components/schemas/{name}"
STRUCTS = (
    RunRequest,
    NodeReport,
    AnyEvent,
    schemas.Error,
    schemas.RunView,
    schemas.RunsPage,
    schemas.RunAccepted,
    schemas.Reduced,
    schemas.NodeStatus,
    schemas.NodesPage,
    schemas.Health,
    schemas.Live,
    schemas.Cancelling,
    schemas.ChromeTrace,
    ChatCompletionRequest,
    ChatCompletion,
    ChatCompletionChunk,
    CompletionRequest,
    TextCompletion,
    TextCompletionChunk,
    ModelList,
    Model,
    OpenAIError,
)
STATIC_TYPES = ("text/html", "text/css", "text/javascript", "application/javascript")
ERRORS = {
    400: "The request is wrong; the error names what.",
    401: "A bearer token is set and the request lacks it or has another.",
    403: "A page on another origin could have sent it: a Host the server does not serve (no token set), "
    "or a change sent from another origin (Origin, Sec-Fetch-Site).",
    404: "No such run, node or file.",
    408: "The body did not arrive in time.",
    409: "The state forbids it (a run already finished, a stage that cannot restart, a run cancelled).",
    410: "The events after Last-Event-ID are no longer remembered, or it is another coordinator process's: "
    "reload the state, reconnect without it.",
    413: "The body is over the limit.",
    415: "A body not sent as Content-Type: application/json.",
    417: "An Expect header other than 100-continue.",
    500: "The run failed (a stage failed during it); the error says where.",
    503: "Not now (a stage down, the store failing, the run queue or event streams full); see Retry-After.",
}


@functools.cache
def components() -> dict[str, dict]:
    """The Structs' schemas, and a node's view: its status and, while a worker holds it, its report.

    Made on the first request for the document, not at import: every coordinator that serves imports this
    module, and few are ever asked for their OpenAPI document.
    """
    tops, components = msgspec.json.schema_components(STRUCTS, ref_template=REF)
    holder = {"description": "No worker holds the stage: the report's fields are absent.", "type": "object"}
    components["NodeView"] = {
        "title": "NodeView",
        "allOf": [_ref("NodeStatus"), {"anyOf": [_ref("NodeReport"), holder]}],
    }
    components["NodesPage"]["properties"]["nodes"]["items"] = _ref("NodeView")
    # Each event the stream sends: one of the event Structs, told apart by `kind`.
    components["Event"] = {"title": "Event", **tops[STRUCTS.index(AnyEvent)]}
    return components


def _ref(name: str) -> dict:
    return {"$ref": REF.format(name=name)}


def _content(media: str, schema: dict | None = None) -> dict:
    return {media: {"schema": schema if schema is not None else {}}}


def _sse(data: str) -> dict:
    """Server-sent events whose `data:` lines are each a `data` (x-data-schema: OpenAPI 3.1 has no word)."""
    return {"text/event-stream": {"schema": {"type": "string"}, "x-data-schema": _ref(data)}}


def _json(name: str) -> dict:
    return _content("application/json", _ref(name))


def _param(name: str, where: str, schema: dict, description: str) -> dict:
    return {
        "name": name,
        "in": where,
        "required": where == "path",
        "schema": schema,
        "description": description,
    }


OUTPUT = _param("output", "query", {"type": "boolean"}, "Include the output (1, true or yes).")
KIND = _param("kind", "query", {"enum": [k.value for k in ReduceKind]}, "How to reduce over the stages.")
RUN_ID = _param("id", "path", {"type": "integer", "minimum": 1}, "A run's id.")
PAGE = [
    _param(
        "limit",
        "query",
        {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
        f"Runs in the page (default {DEFAULT_LIMIT}).",
    ),
    _param(
        "before",
        "query",
        {"type": "integer", "minimum": 1, "maximum": 2**62},
        "Only runs with a smaller id: the previous page's next_before.",
    ),
]


def _op(
    summary: str,
    ok: dict[int, dict],
    errors: tuple[int, ...] = (),
    params: list[dict] | None = None,
    body: dict | None = None,
    public: bool = False,
    error: str = "Error",
) -> dict:
    """One operation: its answers (`ok` by status, then the errors in the `error` shape), parameters, body."""
    responses = {str(s): {"description": ERRORS.get(s, "OK"), "content": c} for s, c in ok.items()}
    # Any request may be refused for where it could come from (coordinator.api.common.same_origin).
    for status in (*errors, 403, *(() if public else (401,))):
        responses[str(status)] = {"description": ERRORS[status], "content": _json(error)}
    op: dict = {"summary": summary, "responses": responses}
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = body
    if public:
        op["security"] = []
    return op


def _run_views(base: str, params: list[dict], which: str) -> dict[tuple[str, str], dict]:
    """The views of one run, as api/runs.py serves them under `base`."""
    return {
        ("GET", base): _op(f"{which} as JSON", {200: _json("RunView")}, (404,), [*params, OUTPUT]),
        ("GET", base + "/table"): _op(
            f"{which} as the monitor table", {200: _content("text/plain")}, (404,), params
        ),
        ("GET", base + "/reduce"): _op(
            f"{which}'s resident memory reduced over the stages",
            {200: _json("Reduced")},
            (400, 404),
            [*params, KIND],
        ),
    }


OPERATIONS: dict[tuple[str, str], dict] = {
    ("GET", "/healthz"): _op(
        "Readiness: whether a run can go through now",
        {200: _json("Health"), 503: _json("Health")},
        public=True,
    ),
    ("GET", "/livez"): _op("Liveness: the process serves", {200: _json("Live")}, public=True),
    ("GET", "/nodes"): _op(
        "Every stage's report and state",
        {200: _json("NodesPage")},
        params=[_param("live", "query", {"type": "boolean"}, "Ask each worker what it holds now.")],
    ),
    ("POST", "/nodes/{index}/restart"): _op(
        "Restart one stage's worker now, outside the automatic budget",
        {200: _json("NodeView")},
        (404, 409, 415),
        [_param("index", "path", {"type": "integer", "minimum": 0}, "The stage's index.")],
    ),
    ("GET", "/runs"): _op("Stored runs, newest first", {200: _json("RunsPage")}, (400,), PAGE),
    ("POST", "/runs"): _op(
        "Queue a run (a prompt for a language model, seq and seed otherwise)",
        {202: _json("RunAccepted")},
        (400, 408, 413, 415, 417, 503),
        body={"required": False, "content": _json("RunRequest")},
    ),
    **_run_views("/run/latest", [], "The latest run"),
    **_run_views("/runs/{id}", [RUN_ID], "One run"),
    ("DELETE", "/runs/{id}"): _op(
        "Cancel a queued or running run: 200 once it has stopped, 202 while it is still stopping",
        {200: _json("RunView"), 202: _json("Cancelling")},
        (404, 409),
        [RUN_ID],
    ),
    ("GET", "/runs/{id}/trace"): _op(
        "One run as a Chrome trace: a track per stage, each forward split into compute and hop",
        {200: _json("ChromeTrace")},
        (404,),
        [RUN_ID],
    ),
    ("GET", "/events"): _op(
        "The event bus as server-sent events (event: kind, id: EPOCH-SEQ, data: an Event)",
        {200: _sse("Event")},
        (400, 410, 503),
        [
            _param("run", "query", {"type": "integer", "minimum": 1, "maximum": 2**62}, "Only this run's."),
            _param(
                "kind", "query", {"type": "string"}, f"Only these kinds, comma-separated: {', '.join(KINDS)}."
            ),
            _param(
                "last_event_id",
                "query",
                {"type": "string"},
                "Resume after this event (EPOCH-SEQ; 0: the oldest).",
            ),
            _param("Last-Event-ID", "header", {"type": "string"}, "Resume after this event (EventSource)."),
        ],
    ),
    ("GET", "/v1/models"): _op(
        "The model served (OpenAI's shape), with the endpoints it serves",
        {200: _json("ModelList")},
        error="OpenAIError",
    ),
    ("GET", "/v1/models/{model}"): _op(
        "One model (OpenAI's shape)",
        {200: _json("Model")},
        (404,),
        [_param("model", "path", {"type": "string"}, "The model's id.")],
        error="OpenAIError",
    ),
    ("POST", "/v1/chat/completions"): _op(
        "A chat completion (OpenAI's shape), whole or streamed as chunks then `data: [DONE]`; a stored run",
        {200: {**_json("ChatCompletion"), **_sse("ChatCompletionChunk")}},
        (400, 404, 408, 409, 413, 415, 417, 500, 503),
        body={"required": True, "content": _json("ChatCompletionRequest")},
        error="OpenAIError",
    ),
    ("POST", "/v1/completions"): _op(
        "A text completion of a prompt as it is, no chat template (OpenAI's shape), whole or streamed as "
        "chunks then `data: [DONE]`; a stored run",
        {200: {**_json("TextCompletion"), **_sse("TextCompletionChunk")}},
        (400, 404, 408, 409, 413, 415, 417, 500, 503),
        body={"required": True, "content": _json("CompletionRequest")},
        error="OpenAIError",
    ),
    ("GET", "/metrics"): _op(
        "Prometheus metrics: runs, tokens, latencies, each stage's time and memory",
        {200: {**_content("text/plain"), **_content("application/openmetrics-text")}},
    ),
    ("GET", "/openapi.json"): _op("This document", {200: _content("application/json", {"type": "object"})}),
    ("GET", "/"): _op(
        "The dashboard page (it asks for the token, when one is set, before reading data)",
        {200: _content("text/html")},
        public=True,
    ),
    ("GET", "/static/{name}"): _op(
        "One of the dashboard's files",
        {200: {m: {} for m in STATIC_TYPES}},
        (404,),
        [_param("name", "path", {"type": "string"}, "The file's name, e.g. app.js.")],
        public=True,
    ),
}


def document(app: web.Application) -> dict:
    """The OpenAPI document of the operations `app` routes."""
    routed = {(route.method, route.resource.canonical) for route in app.router.routes() if route.resource}
    paths: dict[str, dict] = {}
    for (method, path), op in OPERATIONS.items():
        if (method, path) in routed:
            paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "rlx-cluster coordinator",
            "version": version("rlx-cluster"),
            "description": "Runs a transformer as a pipeline of worker processes and shows, per stage, "
            "where time and memory go.",
        },
        "paths": paths,
        "components": {
            "schemas": components(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


def __getattr__(name: str) -> object:
    """COMPONENTS: the schemas of `components()`, made when first read."""
    if name == "COMPONENTS":
        return components()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


async def openapi(request: web.Request) -> web.Response:
    return json_response(document(request.app))


def setup(app: web.Application) -> None:
    """Add GET /openapi.json."""
    app.router.add_get("/openapi.json", openapi)
