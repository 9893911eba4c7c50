"""What a page elsewhere can make a browser send is refused: other hosts, other origins, bodies not JSON.

A real coordinator process on the default set-up (loopback, no token), asked
over raw HTTP with the headers a browser would send, and by Chromium itself.
"""

from __future__ import annotations

import http.client
import json
import socket
from urllib.parse import urlsplit

from aiohttp import web

from coordinator.testing import RlxCluster
from tests.support.chromium import browser

SEQ = b'{"seq": 2}'
JSON = {"Content-Type": "application/json"}
CHAT = json.dumps({"model": "fake:layers=4", "messages": [{"role": "user", "content": "hi"}]}).encode()
EVIL = "rebind.evil.example"


def send(
    cluster: RlxCluster, method: str, path: str, headers: dict[str, str] | None = None,
    body: bytes | None = None,
) -> tuple[int, dict]:  # fmt: skip
    """One request with exactly these headers (a Host among them replaces the real one); status and JSON."""
    where = urlsplit(cluster.base_url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def port(cluster: RlxCluster) -> int:
    return urlsplit(cluster.base_url).port


def test_without_a_token_a_request_naming_a_host_it_does_not_serve_is_refused_as_a_rebound_page_would_send_it(
    rlx_cluster,
):
    c = rlx_cluster()
    for host in (EVIL, f"{EVIL}:{port(c)}", f"{EVIL.upper()}:{port(c)}", "127.0.0.1.nip.io", "[::1"):
        status, body = send(c, "GET", "/runs", {"Host": host})
        assert status == 403, (host, body)
        assert f"Host {host!r} is not an address this server serves" in body["error"]
    assert send(c, "GET", "/", {"Host": EVIL})[0] == 403  # the dashboard too: a rebound page reads nothing
    assert "--allow-host rebind.evil.example" in send(c, "GET", "/runs", {"Host": f"{EVIL}:1"})[1]["error"]
    status, body = send(c, "POST", "/runs", {"Host": EVIL, **JSON}, SEQ)
    assert status == 403 and c.get("/runs").body["runs"] == []
    # Header bytes that are not text are refused like any other name, never a 500.
    assert send(c, "GET", "/runs", {"Host": "\xff\xfe"})[0] == 403
    assert send(c, "POST", "/runs", {"Sec-Fetch-Site": "\xff", **JSON}, SEQ)[0] == 403
    assert send(c, "POST", "/runs", {"Origin": "http://\xff", **JSON}, SEQ)[0] == 403
    assert send(c, "POST", "/runs", {"Content-Type": "\xff"}, SEQ)[0] == 415
    # What a person or a tunnel (ssh -L 9000:localhost:PORT) reaches it by.
    for host in (f"127.0.0.1:{port(c)}", f"localhost:{port(c)}", "LOCALHOST:9000", "[::1]:9000", "127.0.0.2"):
        assert send(c, "GET", "/runs", {"Host": host})[0] == 200, host
    with socket.create_connection(("127.0.0.1", port(c)), timeout=10) as raw:  # HTTP/1.0 names no host
        raw.sendall(b"GET /runs HTTP/1.0\r\n\r\n")
        assert raw.recv(200).startswith(b"HTTP/1.0 200 ")


def test_a_name_the_operator_allows_is_served_and_with_a_token_any_name_meets_the_token_check(rlx_cluster):
    allowed = rlx_cluster(allow_host="Cluster.LAN")
    assert send(allowed, "GET", "/runs", {"Host": f"cluster.lan:{port(allowed)}"})[0] == 200
    assert send(allowed, "GET", "/runs", {"Host": "other.lan"})[0] == 403
    locked = rlx_cluster(token="s3cret")
    # With a token a rebound page cannot pass it; names through proxies and service names need no list.
    assert send(locked, "GET", "/runs", {"Host": EVIL})[0] == 401
    assert send(locked, "GET", "/runs", {"Host": EVIL, "Authorization": "Bearer s3cret"})[0] == 200


def test_a_change_sent_from_another_origin_is_refused_and_changes_nothing(rlx_cluster):
    c = rlx_cluster()
    own = f"http://127.0.0.1:{port(c)}"
    stage = c.stages()[1]
    elsewhere = [
        {"Origin": "http://127.0.0.1:1"},  # another local origin: same site, another port
        {"Origin": f"http://localhost:{port(c)}"},
        {"Origin": "null"},  # a sandboxed frame, a file:// page
        {"Sec-Fetch-Site": "same-site"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Origin": own, "Sec-Fetch-Site": "cross-site"},
    ]
    for headers in elsewhere:
        for method, path, body in (("POST", "/runs", SEQ), ("POST", "/nodes/1/restart", None)):
            status, answer = send(c, method, path, {**headers, **JSON}, body)
            assert status == 403 and "may not change anything here" in answer["error"], (headers, answer)
        status, answer = send(c, "POST", "/v1/chat/completions", {**headers, **JSON}, CHAT)
        assert status == 403 and "may not change anything here" in answer["error"]["message"], answer
    assert c.get("/runs").body["runs"] == []
    assert c.stages()[1] == stage and c.nodes()[1]["restarts"] == 0
    # From its own origin (its own pages), or from no browser at all, a change is taken.
    status, accepted = send(c, "POST", "/runs", {"Origin": own, "Sec-Fetch-Site": "same-origin", **JSON}, SEQ)
    assert status == 202, accepted
    assert send(c, "DELETE", f"/runs/{accepted['id']}", {"Origin": "http://127.0.0.1:1"})[0] == 403
    assert c.wait(accepted["id"])["status"] == "ok"
    # Reading needs no origin check: a browser shows another origin nothing of the answer.
    assert send(c, "GET", "/runs", {"Origin": "http://127.0.0.1:1", "Sec-Fetch-Site": "same-site"})[0] == 200


def test_a_body_not_sent_as_json_is_a_415_naming_the_type_it_needs(rlx_cluster):
    c = rlx_cluster()
    # What a form or a no-cors fetch sends without asking the server first, and what names no type.
    for kind in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; b=x"):
        status, body = send(c, "POST", "/runs", {"Content-Type": kind}, SEQ)
        assert status == 415, (kind, body)
        assert body["error"] == (
            f"the body must be JSON, sent with Content-Type: application/json (this one's is {kind!r})"
        )
    assert send(c, "POST", "/runs", {}, SEQ)[0] == 415
    status, body = send(c, "POST", "/v1/chat/completions", {"Content-Type": "text/plain"}, CHAT)
    assert status == 415 and "application/json" in body["error"]["message"], body
    assert c.get("/runs").body["runs"] == []
    # Refused before the body is sent, to a client that waits to be told to send it.
    with socket.create_connection(("127.0.0.1", port(c)), timeout=10) as raw:
        raw.sendall(
            b"POST /runs HTTP/1.1\r\nHost: 127.0.0.1\r\nExpect: 100-continue\r\nContent-Type: text/plain\r\n"
            b"Content-Length: 10\r\n\r\n"
        )
        assert raw.recv(200).startswith(b"HTTP/1.1 415 ")
    assert send(c, "POST", "/runs", {"Content-Type": "application/json; charset=utf-8"}, SEQ)[0] == 202
    assert send(c, "POST", "/runs", {})[0] == 202  # no body at all: the default run
    assert len(c.get("/runs").body["runs"]) == 2


async def elsewhere_page(request: web.Request) -> web.Response:
    return web.Response(text="<title>elsewhere</title>", content_type="text/html")


async def test_a_page_on_another_local_origin_or_on_a_rebound_name_changes_nothing_in_chromium(rlx_cluster):
    c = await rlx_cluster.astart()
    # The attacker's page: another origin on this host (only its origin matters; it serves nothing).
    attacker = web.Application()
    attacker.router.add_get("/", elsewhere_page)
    runner = web.AppRunner(attacker)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    elsewhere = f"http://127.0.0.1:{runner.addresses[0][1]}/"
    target = c.base_url
    no_cors = f"""Promise.all([
      fetch("{target}/runs", {{method: "POST", mode: "no-cors", body: '{{"seq": 2}}'}}),
      fetch("{target}/runs", {{method: "POST", mode: "no-cors"}}),
      fetch("{target}/nodes/1/restart", {{method: "POST", mode: "no-cors"}}),
      fetch("{target}/runs", {{method: "POST", mode: "no-cors", body: new Blob(['{{"seq": 2}}'])}}),
    ]).then(answers => answers.length)"""
    try:
        async with (
            browser(f"--host-resolver-rules=MAP {EVIL} 127.0.0.1") as chromium,
            chromium.page() as page,
        ):
            await page.goto(elsewhere)
            assert await page.eval(no_cors) == 4  # sent, and answered (opaquely to the page)
            # The attacker's name, rebound to this host: the page now comes from the coordinator's port.
            await page.goto(f"http://{EVIL}:{port(c)}/runs")
            assert "is not an address this server serves" in await page.eval("document.body.innerText")
            post = (
                'fetch("/runs", {method: "POST", headers: {"Content-Type": "application/json"}, body: "{}"})'
            )
            assert await page.eval(post + ".then(r => r.status)") == 403
    finally:
        await runner.cleanup()
    assert (await c.aio.get("/runs")).body["runs"] == []
    assert (await c.aio.nodes())[1]["restarts"] == 0
