"""The browser contributor (producer/web) served at ``/web/``: its demo page and library.

Static files only: the page does its privacy work in the browser and talks to the same gateway
through ``GET /studies/{id}`` and ``POST /studies/{id}/records``. Which directory is served
(``IPDP_GATEWAY_WEB_DIR``):

* unset: this checkout's ``producer/web/dist`` if it was built (``npm run build`` writes
  ``dist/demo/index.html``), else nothing;
* a path: that directory, which must exist;
* empty: nothing (``/web/`` answers 404 like any unknown route).
"""

from __future__ import annotations

import os
from pathlib import Path

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ipdp.errors import ConfigurationError

__all__ = ["DEMO_PATH", "checkout_web_dir", "web_directory", "web_routes"]

#: Where the demo page is, relative to the gateway's origin.
DEMO_PATH = "/web/demo/"

# Module scripts are refused by browsers unless served as JavaScript; the platform's MIME table
# (mimetypes, the Windows registry) is not always right, so the page's own types are fixed here.
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".map": "application/json",
    ".ts": "text/plain; charset=utf-8",
}


def checkout_web_dir() -> Path:
    """``producer/web/dist`` of the source tree this gateway runs from."""
    return Path(__file__).resolve().parent.parent / "producer" / "web" / "dist"


def web_directory(setting: str | None) -> Path | None:
    """The directory to serve for ``IPDP_GATEWAY_WEB_DIR`` (see the module docstring)."""
    if setting is None:
        built = checkout_web_dir()
        return built if (built / "demo" / "index.html").is_file() else None
    if not setting.strip():
        return None
    path = Path(os.path.expanduser(setting.strip()))
    if not path.is_dir():
        raise ConfigurationError(
            f"IPDP_GATEWAY_WEB_DIR={setting!r} is not a directory (build the page with "
            "`cd producer/web && npm ci && npm run build`, or set it empty to serve no page)")
    return path


class WebFiles(StaticFiles):
    """StaticFiles with the page's media types, and revalidated on every load (a rebuilt page
    is never mixed with a cached module of the previous build)."""

    def file_response(self, full_path, stat_result, scope, status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        media = _MEDIA_TYPES.get(Path(full_path).suffix)
        if media is not None and response.status_code != 304:
            response.headers["content-type"] = media
        response.headers["cache-control"] = "no-cache"
        response.headers["x-content-type-options"] = "nosniff"
        return response


async def _to_demo(request: Request) -> Response:
    query = request.url.query
    return RedirectResponse(DEMO_PATH + (f"?{query}" if query else ""), status_code=307)


def web_routes(directory: Path | None) -> list[Route | Mount]:
    """``/web/`` (redirects to the demo page, query kept) and the files under it; none without
    a directory."""
    if directory is None:
        return []
    return [Route("/web/", _to_demo, methods=["GET", "HEAD"]),
            Mount("/web", WebFiles(directory=directory, html=True), name="web")]
