"""The KV blocks a tree's resident branches hold, read from the block manager between two steps: each branch's
block table, each block's reference count and whether the prefix cache lists it, copy-on-write at a branch's
divergence block, and what deleting a branch (with the branches continuing it) would return to the pool."""

from __future__ import annotations

from tokenloop.engine.llm_engine import LLMEngine
from tokenloop.explorer.tree import ExploreTree


def kv_snapshot(engine: LLMEngine, tree: ExploreTree) -> dict:
    """Run on the step thread (AsyncEngine.call)."""
    manager = engine.block_manager
    tables = {}
    cached = {}
    for b in tree.resident():
        seq = engine.retained(b.request_id)
        tables[b.id] = list(seq.block_table)
        cached[b.id] = seq.num_cached_tokens
    holders: dict[int, list[str]] = {}
    for branch_id, table in tables.items():
        for block_id in table:
            holders.setdefault(block_id, []).append(branch_id)
    blocks = {
        str(block_id): {
            "ref_count": manager.blocks[block_id].ref_count,
            "hashed": manager.blocks[block_id].hash is not None,
            "holders": names,
        }
        for block_id, names in sorted(holders.items())
    }
    return {
        "block_size": manager.block_size,
        "num_blocks": manager.num_blocks,
        "num_free_blocks": manager.num_free_blocks,
        "branches": {b: {"blocks": t, "num_cached_tokens": cached[b]} for b, t in tables.items()},
        "blocks": blocks,
        "cow": copies_on_write(tree, tables, manager.block_size),
        "would_free": {
            b: would_free(tree, tables, {int(k): v["ref_count"] for k, v in blocks.items()}, b) for b in tables
        },
    }


def copies_on_write(tree: ExploreTree, tables: dict[str, list[int]], block_size: int) -> list[dict]:
    """A branch that starts inside a block its parent holds wrote its first token into a copy of that block."""
    found = []
    for branch_id, table in tables.items():
        b = tree.branches[branch_id]
        parent = tables.get(b.parent) if b.parent is not None else None
        index = b.start // block_size
        if parent is None or b.start % block_size == 0 or index >= min(len(table), len(parent)):
            continue
        if table[index] != parent[index]:
            found.append({"branch": branch_id, "index": index, "parent_block": parent[index], "block": table[index]})
    return found


def would_free(tree: ExploreTree, tables: dict[str, list[int]], ref_counts: dict[int, int], branch_id: str) -> int:
    """Blocks every reference to which is held by the branch or the branches continuing it."""
    held: dict[int, int] = {}
    for b in tree.descendants(branch_id):
        for block_id in tables.get(b.id, []):
            held[block_id] = held.get(block_id, 0) + 1
    return sum(1 for block_id, count in held.items() if ref_counts[block_id] == count)
