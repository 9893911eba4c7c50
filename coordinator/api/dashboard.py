"""The dashboard: one static page at `/` and its files under `/static/`, all data read by the page itself.

The page and its files hold no data, so they are served without the bearer
token (see OPEN_PATHS in common.py); every endpoint the page reads needs it,
and the page asks for it when one answers 401. A strict Content-Security-Policy
keeps the page to its own script and its own origin.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).with_name("static")
FILES = ("index.html", "app.js", "style.css")
# Only this origin's script and style run and only this origin is read: no inline code, no CDN.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


async def index(request: web.Request) -> web.FileResponse:
    """Serve the dashboard page."""
    return web.FileResponse(STATIC / "index.html", headers=HEADERS)


async def static(request: web.Request) -> web.FileResponse:
    """Serve one of the page's files; nothing else under the folder is reachable."""
    name = request.match_info["name"]
    if name not in FILES:
        raise web.HTTPNotFound(text=f"no static file {name[:40]!r}: there are {', '.join(FILES)}")
    return web.FileResponse(STATIC / name, headers=HEADERS)


def setup(app: web.Application) -> None:
    """Add the dashboard page and its static files."""
    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", static)
