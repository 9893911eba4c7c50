"""The dashboard in a real browser: headless Chromium against a coordinator serving SmolLM2 workers.

One three-stage SmolLM2 cluster is shared by the whole file, served by two
apps: one open, one behind a bearer token. Each test opens its own tab.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from yarl import URL

from coordinator.api import create_app
from coordinator.cluster import Cluster, ClusterConfig, open_cluster
from tests.conftest import eventually, worker_pids
from tests.support.chromium import Browser, Page, browser

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN = "dashboard-s3cret"
PROMPT = "Write two sentences about why the sky is blue."
RUN_TIMEOUT_S = 60.0
PAGE_TIMEOUT_S = 20.0
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=10)

NODE_ROWS = "document.querySelectorAll('#nodes tbody tr').length"
ROWS = "[...document.querySelectorAll('{} tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
# Records, on every change of the page, whether text and stage bars showed while the run was running.
WATCH_LIVE = """
window.seenLive = {text: '', stages: 0};
new MutationObserver(() => {
  if (document.getElementById('run-status').textContent !== 'running') return;
  const text = document.getElementById('generated').textContent;
  if (text.length > window.seenLive.text.length) window.seenLive.text = text;
  const stages = document.querySelectorAll('#stages .stage').length;
  window.seenLive.stages = Math.max(window.seenLive.stages, stages);
}).observe(document.body, {subtree: true, childList: true, characterData: true});
true
"""


class Site:
    """The two apps over the one cluster, and a client session for the API."""

    def __init__(self, cluster: Cluster, open_: TestServer, locked: TestServer) -> None:
        self.cluster, self.open, self.locked = cluster, open_, locked
        self.session = aiohttp.ClientSession(timeout=HTTP_TIMEOUT)

    def url(self, path: str, locked: bool = False) -> str:
        return str((self.locked if locked else self.open).make_url(path))

    async def get(self, path: str, text: bool = False) -> object:
        async with self.session.get(self.url(path)) as r:
            assert r.status == 200, f"GET {path}: {r.status} {await r.text()}"
            return await r.text() if text else await r.json()

    async def finished(self, run_id: int) -> dict:
        async def done() -> dict | None:
            run = await self.get(f"/runs/{run_id}")
            return run if run["status"] not in ("queued", "running") else None

        return await eventually(done, RUN_TIMEOUT_S, f"run {run_id} to finish")

    async def start_run(self, **body: object) -> int:
        async with self.session.post(self.url("/runs"), json=body) as r:
            assert r.status == 202, f"POST /runs: {r.status} {await r.text()}"
            return (await r.json())["id"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def site(smollm2: Path) -> AsyncIterator[Site]:
    async with open_cluster(ClusterConfig("smollm2", 3, build_timeout=120.0)) as cluster:
        servers = [TestServer(create_app(cluster, token), host="127.0.0.1") for token in ("", TOKEN)]
        for server in servers:
            await server.start_server()
        site = Site(cluster, *servers)
        try:
            yield site
        finally:
            await site.session.close()
            for server in servers:
                await server.close()
    assert worker_pids(os.getpid()) == [], "a worker outlived the cluster"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chrome() -> AsyncIterator[Browser]:
    async with browser() as opened:
        yield opened


async def shown_run(page: Page, run_id: int, status: str) -> None:
    """Wait until the run panel shows run `run_id` with `status`."""
    done = (
        f"document.getElementById('run-title').textContent === 'Run {run_id}' && "
        f"document.getElementById('run-status').textContent === '{status}'"
    )
    await page.until(done, RUN_TIMEOUT_S, f"run {run_id} shown {status}")


def text_of(element_id: str) -> str:
    """A JavaScript expression for the text of the element with `element_id`."""
    return f"document.getElementById({element_id!r}).textContent"


def ms(value: float) -> str:
    """A time as the page writes it."""
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.1f} ms"


async def test_the_page_and_its_files_need_no_token_but_the_data_does(site):
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
        for path, kind in (
            ("/", "text/html"),
            ("/static/app.js", "javascript"),
            ("/static/style.css", "css"),
        ):
            async with session.get(site.url(path, locked=True)) as r:
                assert r.status == 200 and kind in r.content_type, (path, r.status, r.content_type)
                assert "script-src 'self'" in r.headers["Content-Security-Policy"]
        for name in ("nope.js", "..%2Fcommon.py", "..%2F..%2Fcluster.py"):
            url = URL(site.url("/static/", locked=True) + name, encoded=True)
            async with session.get(url) as r:
                assert r.status == 404 and "no static file" in (await r.json())["error"], name
        for path in ("/nodes", "/runs", "/run/latest"):
            async with session.get(site.url(path, locked=True)) as r:
                assert r.status == 401, path


async def test_the_page_lists_every_node_with_its_address_layers_state_and_memory(site, chrome):
    async with chrome.page() as page:
        await page.goto(site.url("/"))
        await page.until(f"{NODE_ROWS} === 3", PAGE_TIMEOUT_S, "3 nodes")
        rows = await page.eval(ROWS.format("#nodes"))
        for node, row in zip(site.cluster.pipeline.nodes, rows, strict=True):
            r = node.report
            assert row[:4] == [str(node.index), r.addr, f"{r.layers.start}–{r.layers.end}", "up"]
            assert row[5] == f"{r.resident_bytes / 1e6:.1f} MB"
        assert page.errors == []


async def test_a_run_shows_live_with_its_stages_split_into_compute_and_network_and_its_text(
    site, chrome, tmp_path
):
    async with chrome.page() as page:
        await page.goto(site.url("/"))
        await page.until("document.getElementById('conn').textContent === 'live'", PAGE_TIMEOUT_S, "/events")
        await page.eval(WATCH_LIVE)
        run_id = await site.start_run(prompt=PROMPT, chat=True, max_new_tokens=32)
        await shown_run(page, run_id, "ok")
        listed = f"document.querySelector('#runs tr[data-run=\"{run_id}\"] .pill')?.textContent === 'ok'"
        await page.until(listed, PAGE_TIMEOUT_S, f"run {run_id} listed as ok")
        run = await site.get(f"/runs/{run_id}")
        assert run["text"] and await page.eval(text_of("generated")) == run["text"]
        seen = await page.eval("window.seenLive")
        assert seen["stages"] == 3 and seen["text"] and run["text"].startswith(seen["text"]), seen

        labels = await page.eval("[...document.querySelectorAll('#stages .stage')].map(s => s.textContent)")
        decode = {t["stage"]: t for t in run["decode"]["timings"]}
        for t, label in zip(run["timings"], labels, strict=True):
            # Every forward of the run, the prefill's and each decode step's, summed per stage.
            forward = t["forward_ms"] + decode[t["stage"]]["forward_ms"]
            compute = t["compute_ms"] + decode[t["stage"]]["compute_ms"]
            split = f"forward {ms(forward)} = compute {ms(compute)} + network {ms(max(0, forward - compute))}"
            assert label == f"stage {t['stage']} · {t['addr']}{split}"
        widths = await page.eval("[...document.querySelectorAll('.bar span')].map(b => b.style.width)")
        assert all(w.endswith("%") for w in widths) and max(float(w[:-1]) for w in widths) > 0

        assert await page.eval(text_of("table")) == await site.get(f"/runs/{run_id}/table", text=True)
        first = await page.eval("(r => [r.dataset.run, r.querySelector('a').getAttribute('href')])"
                                "(document.querySelector('#runs tbody tr'))")  # fmt: skip
        assert first == [str(run_id), f"/runs/{run_id}/trace"]
        shot = await page.screenshot(tmp_path / "dashboard.png")
        print(f"dashboard screenshot: {shot}")
        assert shot.stat().st_size > 10_000 and page.errors == []


async def test_markup_in_a_prompt_is_shown_as_text_and_never_runs(site, chrome):
    prompt = '<img src=x onerror="window.pwned = 1"><b>bold</b>'
    run_id = await site.start_run(prompt=prompt, max_new_tokens=2)
    assert (await site.finished(run_id))["status"] == "ok"
    async with chrome.page() as page:
        await page.goto(site.url("/"))
        await page.until(f"document.querySelector('#runs tbody tr')?.dataset.run === '{run_id}'",
                         RUN_TIMEOUT_S, f"run {run_id} listed")  # fmt: skip
        await page.eval(f"document.querySelector('#runs tr[data-run=\"{run_id}\"]').click(); true")
        await shown_run(page, run_id, "ok")
        assert await page.eval(text_of("prompt")) == prompt
        assert await page.eval("document.querySelectorAll('main img, main b').length") == 0
        assert await page.eval("window.pwned") is None and page.errors == []


async def test_with_a_token_set_the_page_asks_for_it_once_and_keeps_it_in_the_tab(site, chrome):
    submit = (
        "document.getElementById('token').value = {!r}; document.getElementById('auth').requestSubmit(); true"
    )
    async with chrome.page() as page:
        await page.goto(site.url("/", locked=True))
        await page.until("!document.getElementById('auth').hidden", PAGE_TIMEOUT_S, "the token form")
        assert await page.eval(NODE_ROWS) == 0

        await page.eval(submit.format("wrong"))
        await page.until("document.getElementById('auth-error').textContent === 'That token was refused.'",
                         PAGE_TIMEOUT_S, "the wrong token refused")  # fmt: skip
        assert await page.eval("!document.getElementById('auth').hidden")

        await page.eval(submit.format(TOKEN))
        await page.until(f"{NODE_ROWS} === 3", PAGE_TIMEOUT_S, "the nodes, with the token")
        assert await page.eval("document.getElementById('auth').hidden")

        await page.goto(site.url("/", locked=True))  # a reload keeps the token: no second question
        await page.until(f"{NODE_ROWS} === 3", PAGE_TIMEOUT_S, "the nodes after a reload")
        assert await page.eval("document.getElementById('auth').hidden") and page.errors == []
