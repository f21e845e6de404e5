"""The playground page as the server serves it (its behaviour in a real browser:
tests/test_playground_browser.py): `GET /` and its files under `/ui/`, static, the same for
everyone and open (they hold nothing of the server's: the page reads everything through the
APIs, with the key the user gives it), nothing fetched from another origin; `--no-ui` serves
none of it; `--api-key` still guards every API path the page calls."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.fakeengine import FakeEngine
from tests.serverproc import InProcess

STATIC = Path(__file__).parent.parent / "server" / "static"


def app_with(**config) -> InProcess:
    from server.app import create_app
    from server.door import ServeConfig

    engine = FakeEngine()
    return InProcess(create_app(engine, ServeConfig(**config)))


@pytest.fixture
def keyed():
    s = app_with(api_key="k3y")
    yield s
    s.stop()


def test_the_page_and_its_files_are_served_open_beside_a_keyed_api(keyed):
    r = keyed.http.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    refs = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert refs and all(ref.startswith(("/ui/", "#", "data:")) for ref in refs), refs
    for ref in refs:
        if ref.startswith("/ui/"):
            got = keyed.http.get(ref)
            assert got.status_code == 200 and got.content == (STATIC / ref[4:]).read_bytes()
    assert keyed.http.get("/v1/models").status_code == 401
    assert keyed.http.get("/metrics").status_code == 401
    assert keyed.http.get("/v1/models", headers={"authorization": "Bearer k3y"}
                          ).status_code == 200
    for up in ("/ui/%2e%2e/door.py", "/ui/%2E%2E/app.py", "/ui/..%2fdoor.py"):
        r = keyed.http.get(up)  # (httpx keeps the escapes: the app sees the raw path)
        assert r.status_code == 404 and "Door" not in r.text, (up, r.text[:200])
    assert keyed.http.get("/ui/nothing.js").status_code == 404


def test_the_page_fetches_nothing_from_another_origin():
    """No CDN, no font or script from elsewhere: every file's URLs are the server's own
    paths (the page works offline)."""
    files = sorted(STATIC.iterdir())
    assert {f.name for f in files} >= {"index.html", "app.js", "style.css"}
    for f in files:
        if f.suffix in (".html", ".js", ".css"):
            text = f.read_text()
            assert not re.search(r"https?://|//cdn|@import|fonts\.googleapis", text), f.name


def test_no_ui_serves_no_page():
    s = app_with(ui=False)
    try:
        assert s.http.get("/").status_code == 404
        assert s.http.get("/ui/app.js").status_code == 404
        assert s.http.get("/health").status_code == 200
    finally:
        s.stop()
