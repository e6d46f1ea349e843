"""Ray Serve request routers for engine replicas (RequestRouterConfig.request_router_class): by prefix
(scale_out/routing.py's choice) and round robin; "pow2" is Ray Serve's own PowerOfTwoChoicesRequestRouter.

They run in the ingress's process, beside the client (scale_out/client.py): a request's keyword arguments carry
its prompt's block hashes and a RouteNote, in which the router leaves its predicted hit for the client to set
beside the replica's actual hit.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from tokenloop.scale_out.routing import Choice, ReplicaView, choose_by_prefix, choose_round_robin

REPORT_LAG_S = 2.0  # a report may miss the prompts sent to its replica up to this long before it was read
ROUTERS = {
    "prefix": "tokenloop.scale_out.routers:PrefixRouter",
    "round-robin": "tokenloop.scale_out.routers:RoundRobinRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
}


@dataclass(slots=True)
class RouteNote:
    predicted_blocks: int | None = None  # leading blocks the router expects its replica to hold (None: no guess)


class _ReplicaViews(RequestRouter):
    """The replicas' reported state (record_routing_stats: cached block hashes, requests in flight, when), plus
    what was routed to each since its report."""

    def initialize_state(self, **kwargs) -> None:
        self.views: dict[str, ReplicaView] = {}
        self.reported_at: dict[str, float] = {}
        self.reported_load: dict[str, int] = {}
        self.routed_since: dict[str, int] = {}
        self.routed: dict[str, deque[tuple[float, list[int]]]] = {}  # recent prompts sent there, when

    def _views(self, candidates: list[RunningReplica]) -> dict[str, ReplicaView]:
        views = {}
        for replica in candidates:
            name = replica.replica_id.unique_id
            view = self.views.setdefault(name, ReplicaView())
            stats = replica.routing_stats or {}  # empty until the replica's first report
            at = stats.get("at")
            if at is not None and at > self.reported_at.get(name, -1.0):  # a new report replaces the guesses
                self.reported_at[name] = at
                self.reported_load[name] = stats.get("in_flight", 0)
                self.routed_since[name] = 0
                view.cached = set(stats.get("cached", ()))
                # But a report read before the prompts sent lately were computed does not have them yet.
                recent = self.routed.setdefault(name, deque())
                while recent and recent[0][0] < at - REPORT_LAG_S:
                    recent.popleft()
                for _, hashes in recent:
                    view.cached.update(hashes)
            view.load = self.reported_load.get(name, 0) + self.routed_since.get(name, 0)
            views[name] = view
        return views

    def choose(self, prompt_hashes: list[int], views: dict[str, ReplicaView]) -> Choice:
        raise NotImplementedError

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        choice = self.choose(pending_request.kwargs.get("block_hashes") or [], self._views(candidate_replicas))
        if (note := pending_request.kwargs.get("route")) is not None:
            note.predicted_blocks = choice.predicted_blocks
        # The choice alone: with later ranks, a first choice slow to answer Serve's queue-length probe (its event
        # loop busy for a moment) would lose the request to the next, cache or not. Serve asks again on a backoff.
        return [[next(r for r in candidate_replicas if r.replica_id.unique_id == choice.order[0])]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        name, hashes = replica_id.unique_id, pending_request.kwargs.get("block_hashes") or []
        self.routed_since[name] = self.routed_since.get(name, 0) + 1
        self.views.setdefault(name, ReplicaView()).cached.update(hashes)
        self.routed.setdefault(name, deque()).append((time.time(), hashes))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        name = replica_id.unique_id
        self.routed_since[name] = self.routed_since.get(name, 0) - 1  # may go below 0: the report counted it


class PrefixRouter(_ReplicaViews):
    def initialize_state(self, max_imbalance: int = 4, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self.max_imbalance = max_imbalance

    def choose(self, prompt_hashes: list[int], views: dict[str, ReplicaView]) -> Choice:
        return choose_by_prefix(prompt_hashes, views, self.max_imbalance)


class RoundRobinRouter(_ReplicaViews):
    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        self.turn = 0

    def choose(self, prompt_hashes: list[int], views: dict[str, ReplicaView]) -> Choice:
        self.turn += 1
        return choose_round_robin(self.turn, views, prompt_hashes)
