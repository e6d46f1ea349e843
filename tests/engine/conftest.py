"""Engine-test fixtures: after every test that used the shared tiny engine, every KV block's reference count is
back to zero; the tiny K-quant Gemma 3 GGUF (tests/engine/test_kquant_engine.py writes it), written once."""

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def blocks_all_freed(request):
    yield
    if "tiny_llm" in request.fixturenames:
        blocks = request.getfixturevalue("tiny_llm").llm_engine.block_manager.blocks
        assert all(b.ref_count == 0 for b in blocks), [b.block_id for b in blocks if b.ref_count]


@pytest.fixture(scope="session")
def kquant_folder(tmp_path_factory) -> Path:
    """The tiny tokenizer's folder, where K-quant GGUFs of its vocabulary are written."""
    from tests.helpers import write_tiny_tokenizer

    return write_tiny_tokenizer(tmp_path_factory.mktemp("kquant_gemma3"))


@pytest.fixture(scope="session")
def kquant_gguf(kquant_folder) -> Path:
    """A six-layer Gemma 3 GGUF of random K-quant blocks (window 8), its formats mixed as gemma-3-270m's are."""
    from tests.engine.test_kquant_engine import write_kquant_gemma3

    return write_kquant_gemma3(kquant_folder / "model.gguf", kquant_folder)
