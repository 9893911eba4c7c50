"""What every face of the HTTP surface shares: app keys, limits, JSON answers, origins, auth, bodies, ids.

Requests a web page elsewhere could make a browser send are refused before any
handler runs (`same_origin`): without a token, one whose Host names neither an
address the server serves, `localhost`, nor a name the operator allows (a page
whose name was rebound to this address sends its own name); with or without
one, a request that would change something and comes from another origin (its
Origin, or Sec-Fetch-Site other than same-origin). A body must be JSON sent as
such (`json_bodies`), so a form or a `text/plain` fetch, which a browser sends
cross-origin without asking first, is a 415.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import msgspec
from aiohttp import web

from coordinator.cluster import Cluster
from coordinator.runs.requests import MAX_PROMPT_CHARS

log = logging.getLogger("coordinator.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CLUSTER = web.AppKey("cluster", Cluster)
TOKEN = web.AppKey("token", str)
BODY_TIMEOUT = web.AppKey("body_timeout", float)
# Names a request's Host may give besides an address the server serves (lowercase, no port).
ALLOWED_HOSTS = web.AppKey("allowed_hosts", frozenset)

# Bytes in a request body; more is a 413. Any prompt within the prompt limit fits, however it is
# escaped: 12 bytes per character is JSON's longest form (a surrogate pair, \uXXXX\uXXXX).
MAX_BODY = 12 * MAX_PROMPT_CHARS + 16 * 1024
# Seconds a client has to send a request body once its head is in; then 408.
BODY_TIMEOUT_S = 30.0
# A JSON body longer than this (bytes) is decoded in a thread, not on the event loop.
INLINE_DECODE_BYTES = 64 * 1024
# A /runs page of more runs than this is built and encoded in a thread (as is any view with an output).
INLINE_PAGE_RUNS = 50
# Digits in an id in a path; a longer one names no run or node (404).
MAX_ID_DIGITS = 18
OPEN_PATHS = ("/healthz", "/livez", "/")
# The dashboard's files hold no data: the page asks for the token before it reads any.
OPEN_PREFIXES = ("/static/",)
KNOWN_STATUSES = frozenset(s.value for s in HTTPStatus)
# Methods that change nothing: any origin may send them (a browser shows it no answer cross-origin).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Sec-Fetch-Site values of a request that may change something: from our own pages, or typed by a person.
OWN_SITES = ("same-origin", "none")
JSON_TYPE = "application/json"


def json_response(data: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response encoded with msgspec."""
    return web.Response(
        body=msgspec.json.encode(data), status=status, content_type="application/json", headers=headers
    )


async def json_off_loop(build: Callable[[], object]) -> web.Response:
    """A JSON response built and encoded in a thread, for views big enough to stall the event loop."""
    body = await asyncio.to_thread(lambda: msgspec.json.encode(build()))
    return web.Response(body=body, content_type="application/json")


class OpenAIErrorBody(msgspec.Struct, kw_only=True):
    """What went wrong, as OpenAI says it.

    message: for a person. type: invalid_request_error (4xx) or server_error (5xx).
    code: a short machine-readable name. param: the request field at fault, when known.
    """

    message: str
    type: str
    code: str | None = None
    param: str | None = None


class OpenAIError(msgspec.Struct):
    """An error answered under /v1, in OpenAI's shape."""

    error: OpenAIErrorBody


def openai_error(status: int, message: str) -> OpenAIError:
    """`message` as OpenAI's error body for HTTP `status`."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    phrase = HTTPStatus(status).phrase if status in KNOWN_STATUSES else "error"
    code = "invalid_api_key" if status == 401 else phrase.lower().replace(" ", "_").replace("-", "_")
    return OpenAIError(OpenAIErrorBody(message=message, type=kind, code=code))


def error(
    status: int, message: str, headers: dict[str, str] | None = None, path: str = ""
) -> web.Response:  # fmt: skip
    """An error in the shape of `path`'s face: OpenAI's under /v1, else {"error": "..."}."""
    if path == "/v1" or path.startswith("/v1/"):
        return json_response(openai_error(status, message), status, headers)
    return json_response({"error": message}, status, headers)


@web.middleware
async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as JSON; nothing the client sends turns into a 500."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        default_text = exc.text is None or exc.text.startswith(str(exc.status))
        return error(exc.status, exc.reason if default_text else exc.text, path=request.path)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error(500, "internal error; see the coordinator log", path=request.path)


@web.middleware
async def same_origin(request: web.Request, handler) -> web.StreamResponse:
    """Refuse (403) a request for a host we do not serve (no token set), or a change from another origin."""
    return _foreign(request) or await handler(request)


def _foreign(request: web.Request) -> web.Response | None:
    """The 403 for a request a page on another origin could have made a browser send, or None."""
    host = request.headers.get("Host")
    if host is not None and not request.app[TOKEN] and not _serves(request, host_name(host)):
        # With a token set, such a request cannot pass the token: names through proxies need no listing.
        why = f"Host {host[:100]!r} is not an address this server serves"
        if (name := host_name(host)[:100]).isascii() and name.isprintable():
            why += f"; to reach it by that name, start it with --allow-host {name}"
        return error(403, why, path=request.path)
    if request.method in SAFE_METHODS:
        return None
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site not in OWN_SITES:
        why = (
            f"a {site[:40]!r} request (Sec-Fetch-Site) may not change anything here: send it from this origin"
        )
        return error(403, why, path=request.path)
    origin = request.headers.get("Origin")
    if origin is not None and origin.partition("://")[2].lower() != (host or "").lower():
        why = f"a request from another origin ({origin[:100]!r}) may not change anything here"
        return error(403, why, path=request.path)
    return None


def host_name(host: str) -> str:
    """The name or address a Host header gives, without its port or brackets, in lowercase."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 address
        address, bracket, port = host[1:].partition("]")
        return address if bracket and (not port or (port[0] == ":" and _is_port(port[1:]))) else host
    name, colon, port = host.rpartition(":")
    return name if colon and _is_port(port) else host


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _serves(request: web.Request, name: str) -> bool:
    """Whether `name` (from the Host header) is an allowed name, or a loopback or our own address."""
    allowed = request.app[ALLOWED_HOSTS]
    if name in allowed:
        return True
    if (address := _address(name)) is None:
        return False
    local = request.transport.get_extra_info("sockname") if request.transport is not None else None
    ours = _address(str(local[0])) if local else None
    return address.is_loopback or address == ours or str(address) in allowed


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`text` as an IP address, or None when it is a name."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


@web.middleware
async def json_bodies(request: web.Request, handler) -> web.StreamResponse:
    """Refuse (415) a body not sent as `Content-Type: application/json`: every body here is JSON."""
    return _not_json(request) or await handler(request)


def _not_json(request: web.Request) -> web.Response | None:
    """The 415 for a request whose body is not declared JSON, or None (also for no body at all)."""
    if request.method in SAFE_METHODS or not request.body_exists or request.content_type == JSON_TYPE:
        return None
    given = request.headers.get("Content-Type", "none")[:100]
    why = f"the body must be JSON, sent with Content-Type: {JSON_TYPE} (this one's is {given!r})"
    return error(415, why, path=request.path)


@web.middleware
async def bearer_token(request: web.Request, handler) -> web.StreamResponse:
    """When a token is set, paths but OPEN_PATHS and OPEN_PREFIXES need `Authorization: Bearer <token>`."""
    return _unauthorized(request) or await handler(request)


def _unauthorized(request: web.Request) -> web.Response | None:
    """The 401 for a request without the right bearer token, or None when it may pass."""
    token = request.app[TOKEN]
    if not token or request.path in OPEN_PATHS or request.path.startswith(OPEN_PREFIXES):
        return None
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    # Header bytes that are not UTF-8 arrive as lone surrogates: compared as the bytes they were.
    given = value.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() == "bearer" and hmac.compare_digest(given, token.encode()):
        return None
    return error(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}, request.path)


async def expect_body(request: web.Request) -> web.Response | None:
    """Say `100 Continue` only to a body that will be read: one the middlewares or the size refuse is now."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        expect = request.headers["Expect"]
        return error(417, f"unsupported Expect: {expect!r}; only 100-continue is", path=request.path)
    if (refusal := _foreign(request) or _unauthorized(request) or _not_json(request)) is not None:
        return refusal
    if request.content_length is not None and request.content_length > MAX_BODY:
        size = request.content_length
        return error(413, f"the body is {size} bytes; the limit is {MAX_BODY}", path=request.path)
    if request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim answer is not the response: errors may still be sent
    return None


async def read_body(request: web.Request) -> bytes:
    """The request's body, refused when over MAX_BODY (413), late (408) or malformed (400)."""
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY, actual_size=request.content_length)
    seconds = request.app[BODY_TIMEOUT]
    try:
        async with asyncio.timeout(seconds):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {seconds:g} s") from None
    except web.RequestPayloadError as exc:
        raise web.HTTPBadRequest(text=f"malformed request body: {exc}") from None
    except ConnectionResetError:  # the client's doing, not ours: no one hears this answer, no traceback
        raise web.HTTPBadRequest(text="the connection closed before the body was complete") from None


def ascii_int(raw: str) -> int | None:
    """`raw` as a number when it is ASCII digits of bounded length, else None (int() also takes '١')."""
    if raw.isascii() and raw.isdigit() and len(raw) <= MAX_ID_DIGITS:
        return int(raw)
    return None


def flag(request: web.Request, name: str) -> bool:
    """True when the query sets `name` to 1, true or yes."""
    return request.query.get(name, "0").lower() in ("1", "true", "yes")


def int_param(request: web.Request, name: str, default: int | None, low: int, high: int) -> int | None:
    """The query's integer `name` within low..high, `default` when absent; else 400."""
    raw = request.query.get(name)
    if raw is None:
        return default
    value = ascii_int(raw)
    if value is None:
        raise web.HTTPBadRequest(text=f"{name} must be an integer in {low}..{high}, got {raw!r}")
    if not low <= value <= high:
        raise web.HTTPBadRequest(text=f"{name} must be in {low}..{high}, got {value}")
    return value
