"""`tokenloop explore`: a server that, once up, opens its explorer page in the browser ($BROWSER here: a script
that writes down the address it was given)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.server.conftest import _free_port


def test_explore_serves_and_opens_the_page_once_the_server_answers(tiny_model_folder, tmp_path):
    opened = tmp_path / "opened"
    browser = tmp_path / "browser.sh"
    browser.write_text(f'#!/bin/sh\necho "$1" > {opened}\n')
    browser.chmod(0o755)
    port = _free_port()
    cmd = [sys.executable, "-m", "tokenloop.cli", "explore", "--model", str(tiny_model_folder), "--port", str(port)]
    cmd += ["--dtype", "float32", "--device", "cpu", "--kv-cache-gb", "0.01", "--api-key", "sekret"]
    with (tmp_path / "log").open("wb") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"BROWSER": str(browser)}
        )
    try:
        deadline = time.monotonic() + 120
        while not (opened.exists() and opened.read_text().strip()) and time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "log").read_text()
            time.sleep(0.2)
        page = opened.read_text().strip()
        assert page == f"http://127.0.0.1:{port}/explore#key=sekret"
        r = httpx.get(page.partition("#")[0])
        assert r.status_code == 200 and '<script type="module"' in r.text  # the page needs no key, its API does
        assert httpx.get(f"http://127.0.0.1:{port}/explore/api/trees").status_code == 401
        headers = {"Authorization": "Bearer sekret"}
        assert httpx.get(f"http://127.0.0.1:{port}/explore/api/trees", headers=headers).json() == {"trees": []}
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
