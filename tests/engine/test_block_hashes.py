"""Prefix-cache block hashes are fixed digests: every process computes the same ones, and two models (nor a model and
one of its LoRA adapters) never share one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tokenloop.engine.block_manager import ROOT_HASH, BlockManager, weights_fingerprint
from tokenloop.engine.lora import LoRARequest, LoRASlot
from tokenloop.engine.sequence import Sequence
from tokenloop.sampling.params import SamplingParams

IDENTITY = "test-model dtype=auto kv=torch.float16"

# The real path: prefix match, allocate, compute, cache the full blocks; then the hashes of the three full blocks.
SNIPPET = f"""
import json
from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.sequence import Sequence
from tokenloop.sampling.params import SamplingParams

m = BlockManager(num_blocks=8, block_size=4, model_identity={IDENTITY!r})
s = Sequence("s", list(range(100, 113)), 13, SamplingParams())
m.match_prefix(s)
assert m.allocate(s, 13)
s.num_computed_tokens = 13
m.cache_full_blocks(s)
print(json.dumps([m.blocks[i].hash for i in s.block_table[:3]]))
"""

# Computed once; a change here changes every block's identity across a fleet, so it should be deliberate.
EXPECTED = [12351150480911969172, 6047594127917343487, 14622644281703090188]


def block_hashes(manager: BlockManager, tokens: list[int], lora: LoRASlot | None = None) -> list[int]:
    s = Sequence("s", list(tokens), len(tokens), SamplingParams(), lora=lora)
    manager.match_prefix(s)
    assert manager.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    manager.cache_full_blocks(s)
    return [manager.blocks[i].hash for i in s.block_table[: s.num_tokens // manager.block_size]]


def test_two_processes_with_different_hash_seeds_compute_the_same_fixed_hashes():
    outputs = []
    for seed in ("0", "12345"):
        env = os.environ | {"PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, check=True)
        outputs.append(json.loads(run.stdout))
    assert outputs[0] == outputs[1] == EXPECTED


def test_this_process_computes_the_same_hashes_and_chains_them():
    m = BlockManager(num_blocks=8, block_size=4, model_identity=IDENTITY)
    assert block_hashes(m, list(range(100, 113))) == EXPECTED
    tokens = tuple(range(100, 113))
    assert m.block_hash(ROOT_HASH, tokens[:4]) == EXPECTED[0]
    assert m.block_hash(EXPECTED[0], tokens[4:8]) == EXPECTED[1]


def test_different_model_identities_give_different_hashes_for_the_same_tokens():
    tokens = list(range(100, 113))
    identities = [IDENTITY, "test-model dtype=float32 kv=torch.float32", "other-model dtype=auto kv=torch.float16", b""]
    hashes = [block_hashes(BlockManager(8, 4, model_identity=i), tokens) for i in identities]
    for i, a in enumerate(hashes):
        for b in hashes[i + 1 :]:
            assert not set(a) & set(b)
    assert block_hashes(BlockManager(8, 4, model_identity=IDENTITY.encode()), tokens) == EXPECTED  # str or its bytes


def test_the_weights_fingerprint_follows_the_file_size_and_its_head_and_tail(tmp_path):
    path = tmp_path / "model.gguf"
    data = bytearray(3 * 2**20)
    path.write_bytes(data)
    original = weights_fingerprint(path)
    assert weights_fingerprint(str(path)) == original
    data[-1] = 1  # in the last MiB
    path.write_bytes(data)
    tail_changed = weights_fingerprint(path)
    path.write_bytes(data + b"\0")
    assert len({original, tail_changed, weights_fingerprint(path)}) == 3
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 64}')
    (folder / "model.safetensors").write_bytes(b"weights")
    before = weights_fingerprint(folder)
    (folder / "config.json").write_text('{"hidden_size": 65}')
    assert weights_fingerprint(folder) != before


def adapter(index: int, identity: str) -> LoRASlot:
    return LoRASlot(index, identity, LoRARequest(f"adapter-{index}", f"/adapters/{index}"))


def test_an_adapters_identity_enters_every_block_hash_and_base_and_adapter_sequences_share_no_block():
    tokens = list(range(100, 117))  # 4 full blocks of 4 (the last token is always recomputed)
    m = BlockManager(num_blocks=16, block_size=4, model_identity=IDENTITY)
    base = block_hashes(m, tokens)
    first, second = adapter(0, "a" * 32), adapter(1, "b" * 32)
    assert base == EXPECTED + [m.block_hash(EXPECTED[2], tuple(tokens[12:16]))]  # the base model's are unchanged
    hashes = [block_hashes(m, tokens, lora) for lora in (first, second)]
    assert not set(base) & set(hashes[0]) and not set(base) & set(hashes[1]) and not set(hashes[0]) & set(hashes[1])
    # The same identity in another slot (another process's numbering) hashes alike: the identity counts, not the slot.
    assert block_hashes(BlockManager(16, 4, model_identity=IDENTITY), tokens, adapter(5, "a" * 32)) == hashes[0]
    m = BlockManager(num_blocks=16, block_size=4, model_identity=IDENTITY)
    for lora, hits in [(None, 0), (first, 0), (second, 0), (first, 16), (None, 16)]:
        s = Sequence("s", list(tokens) + [1], len(tokens) + 1, SamplingParams(), lora=lora)
        m.match_prefix(s)
        assert s.num_cached_tokens == hits
        assert m.allocate(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
        m.cache_full_blocks(s)
        m.free(s)


def test_a_hash_collision_across_adapters_is_caught_by_the_stored_extra_key():
    tokens = list(range(100, 109))
    m = BlockManager(num_blocks=8, block_size=4, model_identity=IDENTITY)
    block_hashes(m, tokens, adapter(0, "a" * 32))
    b = adapter(1, "b" * 32)
    m.block_hash = lambda parent, token_ids, extra=b"": 7  # every block collides
    for block in m.blocks:
        if block.hash is not None:
            m.cached[7] = block.block_id
    s = Sequence("s", list(tokens), len(tokens), SamplingParams(), lora=b)
    m.match_prefix(s)
    assert s.num_cached_tokens == 0
