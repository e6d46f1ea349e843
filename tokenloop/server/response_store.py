"""Stored responses (store: true), so that GET /v1/responses/{id} returns one and previous_response_id continues its
conversation: in memory, bounded, the least recently used evicted first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

DEFAULT_STORED_RESPONSES = 1024


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response as it was returned
    conversation: list[dict[str, Any]]  # template messages through its output, without its instructions


@dataclass(slots=True)
class ResponseStore:
    """Owned by one app; used from its event loop only, so no lock."""

    capacity: int = DEFAULT_STORED_RESPONSES
    _by_id: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._by_id.get(response_id)
        if stored is not None:
            self._by_id.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._by_id[response_id] = stored
        self._by_id.move_to_end(response_id)
        while len(self._by_id) > self.capacity:
            self._by_id.popitem(last=False)

    def __len__(self) -> int:
        return len(self._by_id)
