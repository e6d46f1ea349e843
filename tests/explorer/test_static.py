"""The explorer page's static files: the vendored JavaScript matches VENDOR.json, nothing is fetched off-origin, no
inline script or style (the page is served under CSP default-src 'self'), and every file ships as package data."""

from __future__ import annotations

import fnmatch
import re
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath

import pytest

from tokenloop.explorer import vendor

PACKAGE = Path(vendor.__file__).parents[1]  # tokenloop/
STATIC = PACKAGE / "explorer" / "static"
PACKAGE_DATA_GLOBS = ["explorer/static/*", "explorer/static/vendor/*"]
LICENCES = {"preact": ("MIT", "MIT License"), "htm": ("Apache-2.0", "Apache License")}
# Namespace names that Preact compares against (createElementNS), never fetched: the one kind of URL allowed.
XML_NAMESPACES = ["http://www.w3.org/2000/svg", "http://www.w3.org/1998/Math/MathML", "http://www.w3.org/1999/xhtml"]
URL = re.compile(rb"https?://", re.IGNORECASE)


def static_files() -> list[Path]:
    return sorted(p for p in STATIC.rglob("*") if p.is_file())


def own_modules() -> list[Path]:
    return sorted(STATIC.glob("*.js"))


def test_vendored_files_match_their_recorded_sha256() -> None:
    manifest = vendor.load_manifest()
    assert vendor.check_disk(manifest) == []
    listed = {entry["to"] for package in manifest["packages"] for entry in package["files"]}
    on_disk = {p.name for p in vendor.VENDOR_DIR.iterdir()} - {"VENDOR.json"}
    assert on_disk == listed, "every vendored file is pinned in VENDOR.json, and only those"


def test_hooks_rewrite_reversed_gives_the_published_file() -> None:
    rewritten = [e for package in vendor.load_manifest()["packages"] for e in package["files"] if "rewrite" in e]
    assert [e["to"] for e in rewritten] == ["hooks.mjs"]
    entry = rewritten[0]
    data = (vendor.VENDOR_DIR / entry["to"]).read_bytes()
    original = vendor.apply_rewrite(data, {"old": entry["rewrite"]["new"], "new": entry["rewrite"]["old"]})
    assert vendor.sha256(original) == entry["original_sha256"]
    assert b'from"preact"' not in data and b'from"./preact.mjs"' in data


def test_licences_are_present_and_named() -> None:
    for package in vendor.load_manifest()["packages"]:
        spdx, heading = LICENCES[package["name"]]
        assert package["license"] == spdx
        assert package["version"] and len(package["tarball_sha256"]) == 64
        text = (vendor.VENDOR_DIR / f"LICENSE-{package['name']}").read_text()
        assert heading in text


def test_vendor_check_passes_offline() -> None:
    assert vendor.main(["--check"]) == 0


@pytest.mark.parametrize("path", static_files(), ids=lambda p: str(p.relative_to(STATIC)))
def test_the_page_fetches_nothing_off_origin(path: Path) -> None:
    if path.name.startswith("LICENSE"):
        return
    data = path.read_bytes()
    if path.parent == vendor.VENDOR_DIR:
        for namespace in XML_NAMESPACES:
            data = data.replace(namespace.encode(), b"")
    assert not URL.search(data), f"{path.name} names an absolute URL"
    assert b"data:" not in data and b"blob:" not in data


class _Markup(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict[str, str | None]] = []
        self.styles: list[str] = []
        self.inline: list[str] = []  # style= or on*= attributes
        self._in_script = False
        self.script_bodies: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.inline += [f"<{tag} {name}>" for name, _ in attrs if name == "style" or name.startswith("on")]
        if tag == "script":
            self.scripts.append(dict(attrs))
            self._in_script = True
        if tag == "style":
            self.styles.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.script_bodies.append(data)


def test_index_has_no_inline_script_or_style_and_loads_app_as_a_module() -> None:
    markup = _Markup()
    markup.feed((STATIC / "index.html").read_text())
    assert markup.script_bodies == []
    assert markup.styles == [] and markup.inline == []
    assert {"type": "module", "src": "/explore/static/app.js"} in markup.scripts
    assert all(script.get("src") for script in markup.scripts)


IMPORT = re.compile(r"""(?:^|;)\s*import\s*(?:[\w$*{}\s,]+?\s*from\s*)?["']([^"']+)["']""", re.MULTILINE)


@pytest.mark.parametrize("path", own_modules() + sorted(vendor.VENDOR_DIR.glob("*.mjs")), ids=lambda p: p.name)
def test_every_import_is_a_relative_file_that_exists(path: Path) -> None:
    """No bare specifiers (an import map would be inline script) and no missing module."""
    specs = IMPORT.findall(path.read_text())
    if path.name in ("app.js", "hooks.mjs"):
        assert specs, f"{path.name}: no import found (is the pattern still right?)"
    for spec in specs:
        assert spec.startswith("./"), f"{path.name} imports {spec!r}"
        assert (path.parent / spec).is_file(), f"{path.name} imports {spec!r}, which is not there"


@pytest.mark.parametrize("path", own_modules(), ids=lambda p: p.name)
def test_own_modules_use_classes_and_no_eval(path: Path) -> None:
    text = path.read_text()
    assert not re.search(r"\sstyle=", text), "style through classes in style.css"
    assert "eval(" not in text and "new Function" not in text and "innerHTML" not in text


def _matches(relative: PurePosixPath, pattern: str) -> bool:
    # setuptools expands package-data like glob: `*` never crosses a `/`, so match part by part
    parts = pattern.split("/")
    return len(parts) == len(relative.parts) and all(map(fnmatch.fnmatchcase, relative.parts, parts))


def test_every_static_file_is_package_data() -> None:
    for path in static_files():
        relative = PurePosixPath(path.relative_to(PACKAGE).as_posix())
        assert any(_matches(relative, glob) for glob in PACKAGE_DATA_GLOBS), f"{relative} would not be installed"


def test_pyproject_ships_the_static_globs() -> None:
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]["tokenloop"]
    assert set(PACKAGE_DATA_GLOBS) <= set(package_data)
