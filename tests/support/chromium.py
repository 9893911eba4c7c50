"""Drive headless Chromium over the DevTools protocol: open a page, read its DOM, take a screenshot.

Chromium runs in its own process group with a throw-away profile; `browser()`
kills the group and removes the profile however its block ends.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import aiohttp
import pytest

START_TIMEOUT_S = 30.0  # first start of a fresh profile on 2 busy cores
CALL_TIMEOUT_S = 15.0
STOP_GRACE_S = 5.0
WINDOW = "1360,760"
STDERR_LINES = 40


class PageError(AssertionError):
    """The page threw, or a DevTools call failed."""


class Page:
    """One tab: navigate, evaluate JavaScript, wait for a condition, capture a screenshot."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict]] = {}
        self._loaded = asyncio.Event()
        self.errors: list[str] = []  # uncaught exceptions and console errors, as the page reported them
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            if "id" in data and (fut := self._pending.pop(data["id"], None)) and not fut.done():
                fut.set_result(data)
            elif data.get("method") == "Page.loadEventFired":
                self._loaded.set()
            elif data.get("method") == "Runtime.exceptionThrown":
                details = data["params"]["exceptionDetails"]
                self.errors.append(details.get("exception", {}).get("description") or details["text"])
            elif data.get("method") == "Runtime.consoleAPICalled" and data["params"]["type"] == "error":
                self.errors.append(
                    " ".join(str(a.get("value", a.get("description"))) for a in data["params"]["args"])
                )
        for fut in self._pending.values():
            fut.cancel()

    async def call(self, method: str, **params: object) -> dict:
        """Send one DevTools command and return its result; a protocol error is a PageError."""
        msg_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        await self._ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        async with asyncio.timeout(CALL_TIMEOUT_S):
            reply = await fut
        if "error" in reply:
            raise PageError(f"{method} failed: {reply['error']}")
        return reply["result"]

    async def goto(self, url: str) -> None:
        """Open `url` and wait for its load event (its deferred script has run by then)."""
        self._loaded.clear()
        result = await self.call("Page.navigate", url=url)
        if "errorText" in result:
            raise PageError(f"could not open {url}: {result['errorText']}")
        async with asyncio.timeout(CALL_TIMEOUT_S):
            await self._loaded.wait()

    async def eval(self, expression: str) -> object:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise PageError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, expression: str, timeout: float, what: str) -> object:
        """Poll `expression` until it is truthy; fail after `timeout` seconds, showing the page's text."""
        deadline = time.monotonic() + timeout
        while not (value := await self.eval(expression)):
            if time.monotonic() > deadline:
                text = await self.eval("document.body.innerText")
                raise AssertionError(
                    f"timed out after {timeout}s waiting for {what}; the page shows:\n{text}"
                )
            await asyncio.sleep(0.1)
        return value

    async def screenshot(self, path: Path) -> Path:
        """Write the whole page as a PNG to `path`."""
        metrics = await self.call("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = await self.call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))
        return path

    async def close(self) -> None:
        await self._ws.close()
        with suppress(asyncio.CancelledError):
            await asyncio.wait_for(self._reader, CALL_TIMEOUT_S)


def chromium_path() -> str:
    """Debian's chromium; the test is skipped, saying how to install it, where it is missing."""
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("chromium is not installed: `make test` installs it (apt-get install chromium)")
    return path


@asynccontextmanager
async def browser(*flags: str) -> AsyncIterator[Browser]:
    """A headless Chromium for the block (with these command-line `flags` too), killed and its profile
    removed after it."""
    profile = Path(tempfile.mkdtemp(prefix="rlx-chromium-"))
    proc = await asyncio.create_subprocess_exec(
        chromium_path(), "--headless=new", "--remote-debugging-port=0", f"--user-data-dir={profile}",
        # Root cannot use Chromium's sandbox; the page is our own, served from loopback.
        "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
        "--disable-extensions", "--disable-background-networking", f"--window-size={WINDOW}", *flags,
        "about:blank",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    said: deque[str] = deque(maxlen=STDERR_LINES)
    # Read as it comes: Chromium is chatty on stderr, and a full pipe would stall it.
    reader = asyncio.create_task(_collect(proc, said))
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))
    try:
        port = await _devtools_port(proc, profile, said)
        yield Browser(session, port)
    finally:
        await session.close()
        await _stop(proc)
        with suppress(TimeoutError):
            await asyncio.wait_for(reader, STOP_GRACE_S)
        shutil.rmtree(profile, ignore_errors=True)


async def _collect(proc: asyncio.subprocess.Process, said: deque[str]) -> None:
    while line := await proc.stderr.readline():
        said.append(line.decode(errors="replace"))


class Browser:
    """A running Chromium's DevTools endpoint."""

    def __init__(self, session: aiohttp.ClientSession, port: int) -> None:
        self._session, self._port = session, port

    @asynccontextmanager
    async def page(self) -> AsyncIterator[Page]:
        """A new tab for the block, with exceptions and console errors collected, closed after it."""
        base = f"http://127.0.0.1:{self._port}"
        async with self._session.put(f"{base}/json/new?about:blank") as r:
            target = await r.json()
        ws = await self._session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=64 * 2**20)
        page = Page(ws)
        try:
            await page.call("Page.enable")
            await page.call("Runtime.enable")
            yield page
        finally:
            await page.close()
            async with self._session.get(f"{base}/json/close/{target['id']}") as r:
                await r.read()


async def _devtools_port(proc: asyncio.subprocess.Process, profile: Path, said: deque[str]) -> int:
    """The port Chromium chose, from the DevToolsActivePort file it writes in its profile."""
    active = profile / "DevToolsActivePort"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (active.exists() and active.read_text().strip()):
        if proc.returncode is not None or time.monotonic() > deadline:
            raise AssertionError(f"chromium did not open its DevTools port; it said:\n{''.join(said)}")
        await asyncio.sleep(0.05)
    return int(active.read_text().split()[0])


async def _stop(proc: asyncio.subprocess.Process) -> None:
    """Terminate Chromium's whole process group, then kill it if it outstays the grace period."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), wait)
            break
    # The renderers and helpers share the group: make sure none lingers after the main process.
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
