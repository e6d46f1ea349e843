"""The routers' choice on fixtures of replica states (scale_out/routing.py, no Ray needed), and how the Serve
router reads the replicas' reports (scale_out/routers.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenloop.engine.block_manager import BlockHasher
from tokenloop.scale_out.routing import ReplicaView, choose_by_prefix, choose_round_robin

HASHER = BlockHasher(16, "model")
TENANT_A = HASHER.prompt_hashes(list(range(100, 180)))  # 4 blocks a cache hit can serve
TENANT_B = HASHER.prompt_hashes(list(range(500, 580)))


def test_the_replica_holding_the_longest_leading_run_wins():
    replicas = {
        "r0": ReplicaView(set(TENANT_A[:2]), load=0),
        "r1": ReplicaView(set(TENANT_A) | set(TENANT_B), load=1),
        "r2": ReplicaView(set(TENANT_A[1:]), load=0),  # no leading run: its later blocks count for nothing
    }
    choice = choose_by_prefix(TENANT_A, replicas)
    assert choice.order[0] == "r1" and choice.predicted_blocks == 4
    assert choice.order[1] == "r0"  # then the next longest run


def test_a_replica_loaded_past_the_imbalance_loses_its_hit_to_the_least_loaded():
    replicas = {"r0": ReplicaView(set(TENANT_A), load=9), "r1": ReplicaView(set(), load=2)}
    assert choose_by_prefix(TENANT_A, replicas, max_imbalance=4).order[0] == "r1"
    assert choose_by_prefix(TENANT_A, replicas, max_imbalance=8).order[0] == "r0"


def test_with_no_hit_anywhere_the_least_loaded_then_the_prefixs_own_replica():
    replicas = {"r0": ReplicaView(load=3), "r1": ReplicaView(load=1), "r2": ReplicaView(load=1)}
    choice = choose_by_prefix(TENANT_B, replicas)
    assert choice.order[0] in ("r1", "r2") and choice.predicted_blocks == 0
    # The same prefix picks the same replica among equals, whatever the order the replicas come in.
    reordered = {name: replicas[name] for name in ("r2", "r0", "r1")}
    assert choose_by_prefix(TENANT_B, reordered).order[0] == choice.order[0]
    # And prefixes spread over the replicas rather than all landing on one.
    idle = {f"r{i}": ReplicaView() for i in range(4)}
    firsts = {choose_by_prefix(HASHER.prompt_hashes(list(range(k, k + 40))), idle).order[0] for k in range(0, 800, 40)}
    assert len(firsts) >= 3


def test_round_robin_takes_turns_and_says_what_its_pick_holds():
    replicas = {"r1": ReplicaView(set(TENANT_A)), "r0": ReplicaView()}
    picks = [choose_round_robin(turn, replicas, TENANT_A) for turn in range(4)]
    assert [c.order[0] for c in picks] == ["r0", "r1", "r0", "r1"]
    assert [c.predicted_blocks for c in picks] == [0, 4, 0, 4]


def test_prompt_hashes_are_the_block_managers_own():
    from tokenloop.engine.block_manager import BlockManager

    manager = BlockManager(8, 16, model_identity="model")
    tokens = list(range(100, 180))
    parent, expected = 0, []
    for start in range(0, 64, 16):
        parent = manager.block_hash(parent, tuple(tokens[start : start + 16]))
        expected.append(parent)
    assert HASHER.prompt_hashes(tokens) == expected
    assert HASHER.prompt_hashes(tokens[:64]) == expected[:3]  # the block ending at the last token is not served


def test_a_shared_template_header_does_not_draw_every_new_prefix_to_one_replica():
    header = list(range(1, 17))  # one block every prompt starts with
    tenants = [HASHER.prompt_hashes(header + [t] * 160) for t in range(100, 120)]
    replicas = {"r0": ReplicaView(), "r1": ReplicaView()}
    where = []
    for hashes in tenants:  # each new tenant routed, then its blocks assumed where it went
        name = choose_by_prefix(hashes, replicas).order[0]
        replicas[name].cached.update(hashes)
        where.append(name)
    assert 5 <= where.count("r0") <= 15
    for hashes, name in zip(tenants, where):  # and each comes back to its own
        assert choose_by_prefix(hashes, replicas).order[0] == name


def test_a_replica_that_has_not_reported_yet_is_routed_to_as_holding_nothing():
    """A replica just started has empty routing stats: the router reads it as holding nothing and loaded by what
    it sent there (a request arriving then once failed the router, and hung until its client gave up)."""
    pytest.importorskip("ray.serve")
    from tokenloop.scale_out.routers import PrefixRouter

    router = PrefixRouter.__new__(PrefixRouter)  # the state alone, without a Serve deployment around it
    router.initialize_state()
    fresh = SimpleNamespace(replica_id=SimpleNamespace(unique_id="fresh"), routing_stats={})
    reported = SimpleNamespace(
        replica_id=SimpleNamespace(unique_id="reported"), routing_stats={"cached": [7], "in_flight": 2, "at": 1.0}
    )
    views = router._views([fresh, reported])
    assert views["fresh"].cached == set() and views["fresh"].load == 0
    assert views["reported"].cached == {7} and views["reported"].load == 2
