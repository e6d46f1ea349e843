"""The explorer page's vendored JavaScript (preact, preact/hooks, htm): fetched with `npm pack`, pinned by sha256.

`python -m tokenloop.explorer.vendor` re-creates static/vendor/ from the registry and checks every tarball and file
against VENDOR.json; `--check` only verifies the files on disk (no network); `--record` rewrites the manifest's
hashes and licences from what npm served (after a deliberate version bump in VENDOR.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

VENDOR_DIR = Path(__file__).parent / "static" / "vendor"
MANIFEST = VENDOR_DIR / "VENDOR.json"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_manifest(path: Path = MANIFEST) -> dict[str, Any]:
    return json.loads(path.read_text())


def apply_rewrite(data: bytes, rewrite: dict[str, str]) -> bytes:
    """Replace rewrite["old"] by rewrite["new"]; the old text must occur exactly once, so a new upstream build that
    imports differently fails loudly instead of half-rewritten."""
    old, new = rewrite["old"].encode(), rewrite["new"].encode()
    if data.count(old) != 1:
        raise ValueError(f"rewrite {rewrite['old']!r} expected once, found {data.count(old)} times")
    return data.replace(old, new)


def check_disk(manifest: dict[str, Any], vendor_dir: Path = VENDOR_DIR) -> list[str]:
    """Problems with the vendored files on disk (empty when every sha256 matches the manifest)."""
    problems = []
    for package in manifest["packages"]:
        for entry in package["files"]:
            path = vendor_dir / entry["to"]
            if not path.is_file():
                problems.append(f"{entry['to']}: missing")
            elif sha256(path.read_bytes()) != entry["sha256"]:
                problems.append(f"{entry['to']}: sha256 differs from VENDOR.json")
    return problems


def npm_pack(name: str, version: str, dest: Path) -> Path:
    """Download one package tarball from the registry into dest with the ordinary npm client."""
    out = subprocess.run(
        ["npm", "pack", f"{name}@{version}", "--json", "--pack-destination", str(dest)],
        cwd=dest,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return dest / json.loads(out.stdout)[0]["filename"]


def fetch(manifest: dict[str, Any], record: bool = False) -> dict[str, bytes]:
    """The vendored files' bytes by target name, from fresh tarballs; raises ValueError on any sha256 mismatch
    (with record=True, stores the new hashes and licences in the manifest instead)."""
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for package in manifest["packages"]:
            tarball = npm_pack(package["name"], package["version"], Path(tmp))
            _verify(package, "tarball_sha256", sha256(tarball.read_bytes()), record)
            with tarfile.open(tarball) as tar:
                meta = json.loads(_member(tar, "package/package.json"))
                _verify(package, "license", meta["license"], record)
                for entry in package["files"]:
                    data = _member(tar, entry["from"])
                    if "rewrite" in entry:
                        _verify(entry, "original_sha256", sha256(data), record)
                        data = apply_rewrite(data, entry["rewrite"])
                    _verify(entry, "sha256", sha256(data), record)
                    files[entry["to"]] = data
    return files


def _member(tar: tarfile.TarFile, name: str) -> bytes:
    member = tar.extractfile(name)  # read in memory: nothing from the tarball touches the file system
    if member is None:
        raise ValueError(f"{name} is not a regular file in the tarball")
    return member.read()


def _verify(entry: dict[str, Any], key: str, actual: str, record: bool) -> None:
    if record:
        entry[key] = actual
    elif entry.get(key) != actual:
        raise ValueError(f"{entry.get('to', entry.get('name'))}: {key} is {actual}, VENDOR.json says {entry.get(key)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenloop.explorer.vendor", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only verify the files on disk (no network)")
    mode.add_argument("--record", action="store_true", help="fetch and record new hashes in VENDOR.json")
    args = parser.parse_args(argv)
    manifest = load_manifest()
    if args.check:
        problems = check_disk(manifest)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    try:
        files = fetch(manifest, record=args.record)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    for name, data in files.items():  # written only once every package has checked out
        (VENDOR_DIR / name).write_bytes(data)
    if args.record:
        MANIFEST.write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"vendored {len(files)} files into {VENDOR_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
