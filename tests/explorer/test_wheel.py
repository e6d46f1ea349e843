"""The explorer's page ships in the wheel: a wheel built from a copy of the source tree (no stale build folder to
hide a missing package-data glob) holds every static file."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_every_static_file_of_the_explorer(tmp_path):
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    source = tmp_path / "src"
    for name in listed:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("tokenloop-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    static = ROOT / "tokenloop" / "explorer" / "static"
    expected = {
        f"tokenloop/explorer/static/{p.relative_to(static).as_posix()}" for p in static.rglob("*") if p.is_file()
    }
    assert {"tokenloop/explorer/static/index.html", "tokenloop/explorer/static/vendor/preact.mjs"} <= expected
    assert expected <= shipped, sorted(expected - shipped)
