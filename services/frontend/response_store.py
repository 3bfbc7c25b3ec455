"""The frontend's in-memory store of responses (`store: true`, the default), for
`previous_response_id` and `GET /v1/responses/{id}`.

Bounded by count: at most `capacity` responses (FrontendConfig.max_stored_responses),
least recently used evicted first. A response counts as used when it is stored, read
back with GET, or continued with previous_response_id. Each entry holds the whole
conversation up to and including its output (so a chain survives the eviction of its
earlier turns), which is at most one context's worth of text. Capacity 0 stores
nothing. The store lives in one frontend process: with several API servers a response
is found only by the process that made it, and a restart forgets them all.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvflow.errors import ConfigError
from kvflow.services.frontend.responses_protocol import ResponseObject


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    # The conversation that continues it: earlier turns, this input, this output
    # (instructions excluded: they are not carried over).
    messages: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ConfigError("max_stored_responses must be >= 0")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry
