"""Where a request goes among engine replicas: the choice alone, on plain data, so that it can be checked on any
fixture of replica states (the Ray Serve routers in scale_out/routers.py call it).

A replica reports the chain hashes of the blocks in its prefix cache (the engine's own, process-stable:
engine/block_manager.py); the router adds the prompts it has sent there since. A request's prompt hashes the same
way; its expected hit on a replica is the run of its leading blocks found there. The replica with the longest
run wins, among those whose load is within `max_imbalance` requests of the least loaded, where it holds clearly
more than the others (2 blocks, and `min_share` of the prompt's); else the least loaded, ties broken by the prompt's
first block no replica holds (rendezvous hashing), so that a new prefix lands on the same replica whichever
request brings it first, and new prefixes spread over the replicas.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(slots=True)
class ReplicaView:
    """What a router knows of one replica: the block hashes it holds (reported, plus those routed there since the
    report) and the requests it runs."""

    cached: set[int] = field(default_factory=set)
    load: int = 0

    def leading_hits(self, prompt_hashes: list[int]) -> int:
        hits = 0
        for block_hash in prompt_hashes:
            if block_hash not in self.cached:
                break
            hits += 1
        return hits


@dataclass(frozen=True, slots=True)
class Choice:
    order: list[str]  # the replicas, best first
    predicted_blocks: int  # leading blocks expected in the first one's cache


def _rendezvous(key: int, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}:{replica}".encode(), digest_size=8).digest()


def choose_by_prefix(
    prompt_hashes: list[int], replicas: dict[str, ReplicaView], max_imbalance: int = 4, min_share: float = 0.25
) -> Choice:
    least = min(view.load for view in replicas.values())

    def hits(name: str) -> int:
        view = replicas[name]
        return view.leading_hits(prompt_hashes) if view.load - least <= max_imbalance else 0

    found = {name: hits(name) for name in replicas}
    best, common = max(found.values()), min(found.values())
    # A hit decides only where one replica holds clearly more of the prompt than the others (a shared template
    # header, held everywhere or by one replica only, must not draw every request to one replica).
    if best - common >= max(2, round(min_share * len(prompt_hashes))):
        order = sorted(replicas, key=lambda name: (-found[name], replicas[name].load, name))
        return Choice(order, found[order[0]])
    # Else the least loaded, ties broken by the prompt's first block that no replica holds (rendezvous hashing):
    # the requests of one new prefix go to the same replica, and different prefixes spread.
    key = prompt_hashes[best] if best < len(prompt_hashes) else (prompt_hashes[-1] if prompt_hashes else 0)
    order = sorted(replicas, key=lambda name: (replicas[name].load, _rendezvous(key, name)))
    return Choice(order, found[order[0]])


def choose_round_robin(turn: int, replicas: dict[str, ReplicaView], prompt_hashes: list[int]) -> Choice:
    """The turn-th replica in name order, and what it would hit."""
    names = sorted(replicas)
    order = names[turn % len(names) :] + names[: turn % len(names)]
    return Choice(order, replicas[order[0]].leading_hits(prompt_hashes))
