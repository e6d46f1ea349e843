"""The model store: names resolve to cached files, bad names and paths are clear errors, pulls are verified."""

from __future__ import annotations

import dataclasses

import pytest

from tokenloop.models import store


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'nope'; known models: smollm2-135m-instruct"):
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
