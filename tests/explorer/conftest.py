"""The explorer's fixtures: a server on the tiny model (and one with n-gram speculative decoding), API clients that
let each test's trees go after it, and the browser (Debian's chromium through Playwright; skipped where there is
none, failed where TOKENLOOP_REQUIRE_BROWSER=1, as in CI)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.explorer.page_driver import CHROMIUM, CHROMIUM_ARGS, SPEC_CONFIG, VIEWPORT, Page, sync_playwright
from tests.server.conftest import start_server, stop_server


def _no_browser(reason: str):
    if os.environ.get("TOKENLOOP_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (TOKENLOOP_REQUIRE_BROWSER=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    if sync_playwright is None:
        _no_browser("Playwright for Python is not installed")
    if not Path(CHROMIUM).exists():
        _no_browser(f"no chromium at {CHROMIUM} (apt-get install chromium fonts-liberation)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tiny_model_folder, tmp_path_factory):
    s = start_server(tiny_model_folder, tmp_path_factory.mktemp("explore_page") / "server.log", "--kv-cache-gb", "0.01")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def spec_server(tiny_model_folder, tmp_path_factory):
    s = start_server(
        tiny_model_folder,
        tmp_path_factory.mktemp("explore_page_spec") / "server.log",
        "--kv-cache-gb",
        "0.01",
        "--speculative-config",
        json.dumps(SPEC_CONFIG),
    )
    yield s
    stop_server(s)


def _delete_trees(client) -> None:
    for tree in client.get("/explore/api/trees").json()["trees"]:
        client.delete(f"/explore/api/trees/{tree['id']}")


@pytest.fixture
def http(server):
    """An API client; each test's trees are let go after it."""
    with server.http() as client:
        yield client
        _delete_trees(client)


@pytest.fixture
def spec_http(spec_server):
    with spec_server.http() as client:
        yield client
        _delete_trees(client)


@pytest.fixture
def open_page(browser):
    """open_page(server) -> Page: a fresh browser context on the server's /explore, closed after the test."""
    opened = []

    def open_(server) -> Page:
        context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
        context.set_default_timeout(20_000)
        opened.append(context)
        return Page(context.new_page(), server)

    yield open_
    for context in opened:
        context.close()


@pytest.fixture
def page(open_page, server):
    """The page on the tiny model's server. After the test: no page error, no console error, no 4xx or 5xx and no
    request off the origin, but for what the test provoked on purpose."""
    p = open_page(server)
    yield p
    assert p.watch.unexpected() == []
