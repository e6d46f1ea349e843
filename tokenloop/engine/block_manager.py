"""KV block manager: hands out fixed-size cache blocks, counts references, caches full blocks by prefix hash,
forks sequences (a child shares its parent's blocks) and copies a shared block on write.

It counts integers only; the tensors live in the model runner (which does the copies listed here). A full block is
keyed by a hash chained to its parent's hash, its own token ids, the model's identity and the sequence's extra key
(its adapter's identity), so equal keys mean equal prefixes of one model (token ids and extra keys are compared on
a hit as well, so a hash collision can never serve the wrong cache). The hash is a fixed digest, not
Python's salted `hash`, so that two processes (prefill and decode workers, replicas behind a router) agree on it.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenloop.engine.sequence import Sequence

if TYPE_CHECKING:
    from tokenloop.engine.lora import LoRASlot


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its K/V computed
    token_ids: tuple[int, ...] = ()
    extra: bytes = b""  # the extra key it was hashed with (its sequence's adapter identity)
    group: int = 0  # the KV cache group whose layers it holds, once hashed


ROOT_HASH = 0  # the parent hash of a sequence's first block
_MIB = 2**20


def weights_fingerprint(path: str | os.PathLike) -> str:
    """A cheap digest of a model's weights that every process computes alike: the size, first and last MiB of a
    .gguf file, or of each .json / .safetensors file of a Hugging Face folder (with its name)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith((".json", ".safetensors")))
        files = [os.path.join(path, f) for f in files]
    else:
        files = [path]
    digest = hashlib.sha256()
    for file in files:
        size = os.path.getsize(file)
        digest.update(f"{os.path.basename(file)}:{size}:".encode())
        with open(file, "rb") as f:
            digest.update(f.read(_MIB))
            f.seek(max(size - _MIB, 0))
            digest.update(f.read(_MIB))
    return digest.hexdigest()[:32]


class BlockHasher:
    """A model's block hashes: what the block manager keys its cache with, and what a router predicts hits by."""

    def __init__(self, block_size: int, model_identity: str | bytes = b"") -> None:
        self.block_size = block_size
        identity = model_identity.encode() if isinstance(model_identity, str) else bytes(model_identity)
        # The identity is hashed once; each block copies that state and adds its parent's hash and its token ids,
        # packed little-endian (int64 each) so that every machine feeds the digest the same bytes.
        self._identity_hasher = hashlib.blake2b(identity, digest_size=8)
        self._pack_block = struct.Struct(f"<Q{block_size}q").pack

    def block_hash(self, parent_hash: int, token_ids: tuple[int, ...], extra: bytes = b"") -> int:
        """The 64-bit chain hash of a full block (ROOT_HASH is the first block's parent); `extra`: what else its
        K/V depend on (vLLM's extra keys: a LoRA adapter's identity), every block of the chain hashing it."""
        hasher = self._identity_hasher.copy()
        hasher.update(self._pack_block(parent_hash, *token_ids))
        if extra:
            hasher.update(extra)
        return int.from_bytes(hasher.digest(), "little")

    def chain_hashes(
        self, token_ids: list[int], first: int, end: int, parent_hash: int = ROOT_HASH, extra: bytes = b""
    ) -> list[int]:
        """The chain hashes of blocks [first, end) of token_ids, block `first`'s parent hash being `parent_hash`."""
        hashes, size = [], self.block_size
        for i in range(first, end):
            parent_hash = self.block_hash(parent_hash, tuple(token_ids[i * size : (i + 1) * size]), extra)
            hashes.append(parent_hash)
        return hashes

    def prompt_hashes(self, token_ids: list[int], extra: bytes = b"") -> list[int]:
        """The chain hashes of a prompt's blocks that a cache hit can serve: its full blocks before its last token
        (whose logits are always computed)."""
        return self.chain_hashes(token_ids, 0, (len(token_ids) - 1) // self.block_size, extra=extra)


def block_identity(path: str | os.PathLike, dtype: str, kv_cache_dtype: object) -> str:
    """What a block's K/V depend on besides its tokens: the weights, their precision ("auto" keeps them quantized)
    and the cache's dtype. Engines (and a router) that agree on it agree on every block hash."""
    return f"{weights_fingerprint(path)} dtype={dtype} kv={kv_cache_dtype}"


NULL_BLOCK = -1  # a sliding group's table entry for a block given back (wholly before the window): never read


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        model_identity: str | bytes = b"",
        windows: tuple[int | None, ...] = (None,),
    ) -> None:
        """model_identity: whatever a block's K/V depend on besides its tokens (the weights, dtypes; an adapter's
        name), so that two models never share a block hash. windows: per KV cache group (engine/kv_groups.py), its
        sliding window (None: full attention); each sequence holds a block table per group."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.hasher = BlockHasher(block_size, model_identity)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks in the order they are handed out: freed blocks that hold no cached prefix first
        # (most recently freed first, so that a long run keeps reusing the same few pages of the pool instead
        # of touching all of it), then cached ones, least recently freed first; O(1) removal from the middle
        # when a cache hit revives one. Cached contents survive here until the block is handed out again.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Per group, chain hash → block id (a block holds one group's layers: equal hashes of two groups are
        # different K/V).
        self.cached_by_group: list[dict[int, int]] = [{} for _ in self.windows]
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache, and how many were found
        self.prefix_hit_tokens = 0
        self.num_released_blocks = 0  # blocks sliding groups gave back, wholly before their window
        # (source, destination) block copies owed before the next forward pass: a sequence about to write into a
        # block it shares got a copy of its own (copy on write). The scheduler hands them to the step.
        self.pending_copies: list[tuple[int, int]] = []

    def block_hash(self, parent_hash: int, token_ids: tuple[int, ...], extra: bytes = b"") -> int:
        return self.hasher.block_hash(parent_hash, token_ids, extra)

    @staticmethod
    def extra_key(seq: Sequence) -> bytes:
        return BlockManager.lora_key(seq.lora)

    @staticmethod
    def lora_key(lora: LoRASlot | None) -> bytes:
        """The extra key of a sequence running adapter `lora` (None: the base model)."""
        return lora.identity.encode() if lora is not None else b""

    @property
    def cached(self) -> dict[int, int]:
        """The first group's cached blocks (a model with one group: all of them): what a router predicts hits by."""
        return self.cached_by_group[0]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence references (free blocks may still hold cached prefixes)."""
        return len(self.blocks) - len(self.free_queue)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
        return seq.block_tables

    def _window_start(self, position: int, window: int | None) -> int:
        """The first block a query at `position` reads in a group of `window` (a full group: block 0)."""
        return 0 if window is None else max(position - window + 1, 0) // self.block_size

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its first `num_tokens` tokens have slots in every group (and the block it
        writes next is its own in each)."""
        count = -(-num_tokens // self.block_size)
        tables = seq.block_tables or [[] for _ in self.windows]
        return sum(max(0, count - len(table)) + self._shared_write_block(seq, table, num_tokens) for table in tables)

    def _shared_write_block(self, seq: Sequence, table: list[int], num_tokens: int) -> bool:
        """Whether the next tokens of `seq` would be written into a block of `table` another sequence also holds,
        or into a block of the prefix cache (a fork inside a full block: the cache lists it under other tokens,
        and a later hit must read those)."""
        index = seq.num_computed_tokens // self.block_size
        if num_tokens <= seq.num_computed_tokens or index >= len(table):
            return False
        block = self.blocks[table[index]]
        return block.ref_count > 1 or block.hash is not None

    def fork(self, parent: Sequence, child: Sequence, num_computed_tokens: int) -> int:
        """Give `child` (holding no blocks), whose first `num_computed_tokens` tokens are the parent's, the blocks
        that hold them, by reference; returns the tokens it shares. Whichever of them next writes into a shared
        block gets a copy of it first. A fork further back than a sliding group's kept blocks shares nothing (the
        child computes its tokens again: the prefix cache may still return them)."""
        assert not child.block_tables
        count = -(-num_computed_tokens // self.block_size)
        for window, table in zip(self.windows, parent.block_tables):
            if NULL_BLOCK in table[self._window_start(num_computed_tokens, window) : count]:
                return 0
        child.block_tables = [table[:count] for table in parent.block_tables]
        for table in child.block_tables:
            for block_id in table:
                if block_id != NULL_BLOCK:
                    self.blocks[block_id].ref_count += 1
        # Only blocks full of tokens the child keeps are hashed for it (a fork may land inside a full block).
        child.block_hashes = parent.block_hashes[: num_computed_tokens // self.block_size]
        return num_computed_tokens

    def match_prefix(self, seq: Sequence) -> None:
        """Take cached blocks for the longest cached prefix of a sequence that holds no blocks yet: every block
        of it in each full group, the blocks its next query's window reaches in each sliding group.

        The last prompt token is always recomputed, since its logits are needed to sample. A sequence that
        scores its prompt takes nothing: each of its positions' logits is needed.
        """
        assert not seq.block_tables and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.score_prompt:
            return
        extra, size = self.extra_key(seq), self.block_size
        hashes = self.hasher.prompt_hashes(seq.token_ids, extra)
        tokens = [tuple(seq.token_ids[i * size : (i + 1) * size]) for i in range(len(hashes))]

        def hit(group: int, i: int) -> int | None:
            block_id = self.cached_by_group[group].get(hashes[i])
            if block_id is None or (self.blocks[block_id].token_ids, self.blocks[block_id].extra) != (tokens[i], extra):
                return None
            return block_id

        count = len(hashes)  # the blocks taken: the query at count * size reads the window before it
        while count and not all(
            hit(g, i) is not None
            for g, window in enumerate(self.windows)
            for i in range(self._window_start(count * size, window), count)
        ):
            count -= 1
        seq.block_tables = [[NULL_BLOCK] * self._window_start(count * size, window) for window in self.windows]
        for g, table in enumerate(seq.block_tables):
            for i in range(len(table), count):
                block_id = hit(g, i)
                self._take(block_id)
                table.append(block_id)
        seq.block_hashes = hashes[:count]
        seq.num_computed_tokens = seq.num_cached_tokens = count * size

    def count_prefix_lookup(self, seq: Sequence) -> None:
        """Count a sequence's last prefix lookup in the hit rate, as it is scheduled: a sequence that waited a step
        after a lookup (for blocks being computed, or for free blocks) looked again."""
        if self.enable_prefix_caching and not seq.score_prompt:
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_cached_tokens

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` slots for its first `num_tokens` tokens; False (and nothing taken) if blocks run out."""
        if self.blocks_needed(seq, num_tokens) > len(self.free_queue):
            return False
        count = -(-num_tokens // self.block_size)
        for table in self._tables(seq):
            if self._shared_write_block(seq, table, num_tokens):
                index = seq.num_computed_tokens // self.block_size
                shared, own = table[index], self._new_block()
                self._drop(shared)  # another sequence holds it, or it stays in the prefix cache
                table[index] = own
                del seq.block_hashes[index:]
                self.pending_copies.append((shared, own))
            while len(table) < count:
                table.append(self._new_block())
        return True

    def _new_block(self) -> int:
        block_id = next(iter(self.free_queue))
        self._evict(block_id)
        self._take(block_id)
        return block_id

    def holds(self, group: int, block_hash: int, token_ids: tuple[int, ...], extra: bytes = b"") -> bool:
        """Whether group `group`'s block of `block_hash` is cached here; if so and unused, it becomes the last to
        be evicted."""
        block_id = self.cached_by_group[group].get(block_hash)
        if block_id is None or (self.blocks[block_id].token_ids, self.blocks[block_id].extra) != (token_ids, extra):
            return False
        if block_id in self.free_queue:
            self.free_queue.move_to_end(block_id)
        return True

    def adopt(self, group: int, block_hash: int, token_ids: tuple[int, ...], extra: bytes = b"") -> int:
        """A free block made group `group`'s cached block of `block_hash`, unused and the last to be evicted: one
        whose K/V another engine computed (a prefill worker's), which the caller writes before the next step. The
        caller checks that a block is free."""
        block_id = next(iter(self.free_queue))
        self._evict(block_id)
        block = self.blocks[block_id]
        block.hash, block.token_ids, block.extra, block.group = block_hash, token_ids, extra, group
        self.cached_by_group[group][block_hash] = block_id
        self.free_queue.move_to_end(block_id)
        return block_id

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def blocks_written(self, seq: Sequence, num_tokens: int) -> list[int]:
        """The chain hashes of the full blocks that `seq`'s next `num_tokens` tokens write into (from its computed
        ones on): the blocks that, once computed, another sequence of the same tokens can take from the prefix
        cache. Empty without the cache (or where its chain was not kept)."""
        size, start = self.block_size, seq.num_computed_tokens
        first, end = start // size, min(-(-(start + num_tokens) // size), len(seq.token_ids) // size)
        if not self.enable_prefix_caching or len(seq.block_hashes) < first:
            return []
        parent = seq.block_hashes[first - 1] if first else ROOT_HASH
        return self.hasher.chain_hashes(seq.token_ids, first, end, parent, self.extra_key(seq))

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that became full of computed tokens under their chain hashes, in every
        group; then a sliding group gives back its blocks wholly before the window of the sequence's next query
        (cached ones stay in the prefix cache until handed out again)."""
        size, full = self.block_size, seq.num_computed_tokens // self.block_size
        if self.enable_prefix_caching:
            extra, start = self.extra_key(seq), len(seq.block_hashes)
            tokens = [tuple(seq.token_ids[i * size : (i + 1) * size]) for i in range(start, full)]
            parent = seq.block_hashes[-1] if start else ROOT_HASH
            seq.block_hashes += self.hasher.chain_hashes(seq.token_ids, start, full, parent, extra)
            for group, table in enumerate(seq.block_tables):
                for i, block_tokens in enumerate(tokens, start):
                    block = self.blocks[table[i]] if table[i] != NULL_BLOCK else None
                    if block is not None and block.hash is None:  # a block taken from the cache has its hash
                        block.token_ids, block.extra = block_tokens, extra
                        block.hash, block.group = seq.block_hashes[i], group
                        self.cached_by_group[group].setdefault(block.hash, block.block_id)
        # The next query is at num_computed_tokens or later; a block more is kept so that a fork one token back
        # (the other completions of n) or a decode worker's prefix hit (up to the prompt's last full block) finds
        # its window whole.
        for window, table in zip(self.windows, seq.block_tables):
            end = self._window_start(seq.num_computed_tokens - size, window)
            start = end
            while start and table[start - 1] != NULL_BLOCK:  # the blocks given back before are a prefix
                start -= 1
            for i in range(start, end):
                self._drop(table[i])
                table[i] = NULL_BLOCK
            self.num_released_blocks += end - start

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past `seq`'s tokens (they held only rejected draft tokens' K/V), tail first."""
        keep = -(-seq.num_tokens // self.block_size)
        for table in seq.block_tables:
            for block_id in reversed(table[keep:]):
                self._drop(block_id)
            del table[keep:]
        del seq.block_hashes[keep:]

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references, tail first, so that the tail of a prefix chain is evicted first."""
        for table in seq.block_tables:
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    self._drop(block_id)
        seq.block_tables = []
        seq.block_hashes = []

    def _drop(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            if block.hash is None:
                self.free_queue.move_to_end(block_id, last=False)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None and self.cached_by_group[block.group].get(block.hash) == block_id:
            del self.cached_by_group[block.group][block.hash]
        block.hash, block.token_ids, block.extra = None, (), b""
