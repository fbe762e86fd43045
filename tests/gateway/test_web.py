"""The gateway serves the browser contributor's page at /web/: module scripts as JavaScript, the
query string kept on the way to the demo page, nothing when there is no page."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest

from gateway.web import checkout_web_dir, web_directory
from ipdp.errors import ConfigurationError
from tests.gateway.conftest import running_gateway


def get(url: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """One GET, redirects not followed: (status, lower-cased headers, body)."""
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.fixture
def page(tmp_path):
    """A stand-in for producer/web/dist: the demo page and one library module."""
    (tmp_path / "demo").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "demo" / "index.html").write_text("<!doctype html><title>demo</title>")
    (tmp_path / "demo" / "app.js").write_text('import "../src/index.js";')
    (tmp_path / "demo" / "style.css").write_text("body {}")
    (tmp_path / "src" / "index.js").write_text("export const x = 1;")
    return tmp_path


def test_the_page_and_its_modules_are_served_with_their_media_types(
        page, kafka_settings, topics):
    with running_gateway(kafka_settings, topics, ready=False, web_dir=str(page)) as url:
        status, headers, body = get(url, "/web/demo/")
        assert (status, body) == (200, b"<!doctype html><title>demo</title>")
        assert headers["content-type"] == "text/html; charset=utf-8"
        for path, media in (("/web/demo/app.js", "text/javascript; charset=utf-8"),
                            ("/web/src/index.js", "text/javascript; charset=utf-8"),
                            ("/web/demo/style.css", "text/css; charset=utf-8")):
            status, headers, _ = get(url, path)
            assert (status, headers["content-type"]) == (200, media), path
            assert headers["x-content-type-options"] == "nosniff"
            assert headers["cache-control"] == "no-cache"


def test_web_root_redirects_to_the_demo_page_keeping_the_query(page, kafka_settings, topics):
    with running_gateway(kafka_settings, topics, ready=False, web_dir=str(page)) as url:
        status, headers, _ = get(url, "/web/?study=s1&key=A%2Bb%3D")
        assert (status, headers["location"]) == (307, "/web/demo/?study=s1&key=A%2Bb%3D")


def test_a_missing_file_is_the_gateways_json_404(page, kafka_settings, topics):
    with running_gateway(kafka_settings, topics, ready=False, web_dir=str(page)) as url:
        status, _, body = get(url, "/web/demo/nope.js")
    assert status == 404
    assert json.loads(body)["error"] == "not_found"


def test_an_empty_setting_serves_no_page(page, kafka_settings, topics):
    with running_gateway(kafka_settings, topics, ready=False, web_dir="") as url:
        assert get(url, "/web/demo/")[0] == 404


def test_the_default_is_the_checkout_build_only_once_built_and_a_bad_path_is_refused(tmp_path):
    built = (checkout_web_dir() / "demo" / "index.html").is_file()
    assert web_directory(None) == (checkout_web_dir() if built else None)
    assert web_directory("  ") is None
    assert web_directory(str(tmp_path)) == tmp_path
    with pytest.raises(ConfigurationError, match="IPDP_GATEWAY_WEB_DIR"):
        web_directory(str(tmp_path / "missing"))
