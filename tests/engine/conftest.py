"""After every engine test that used the shared tiny engine, every KV block's reference count is back to zero."""

import pytest


@pytest.fixture(autouse=True)
def blocks_all_freed(request):
    yield
    if "tiny_llm" in request.fixturenames:
        blocks = request.getfixturevalue("tiny_llm").llm_engine.block_manager.blocks
        assert all(b.ref_count == 0 for b in blocks), [b.block_id for b in blocks if b.ref_count]
