"""One choice's token counts, for usage and return_token_ids, and the tokens a resumed
stream had sent before it broke (kv_params.py: the proxy's `kv_resume`)."""

from __future__ import annotations

from kvflow.proto.frontend import RequestOutputDelta


class ChoiceCounts:
    """Token counts of one choice, for usage."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.token_ids: list[int] = []  # for return_token_ids
        self.resuming = False  # resumed (kv_resume): its first delta's resumed_text is due

    def resume(self, token_ids: list[int], finished: bool) -> None:
        """A resumed stream's tokens so far count as this choice's, as in one
        uninterrupted run; their text comes with the first delta (`take_resumed_text`),
        unless it finished (then no delta comes)."""
        self.num_tokens += len(token_ids)
        self.token_ids += token_ids
        self.resuming = not finished

    def take_resumed_text(self, delta: RequestOutputDelta) -> str | None:
        """On a resumed choice's first delta, the text the old stream had sent, for the
        choice's stream state to absorb before the delta (the client has it already)."""
        if not self.resuming:
            return None
        self.resuming = False
        return delta.resumed_text

    def count(self, delta: RequestOutputDelta) -> None:
        self.num_tokens += len(delta.token_ids)
        self.token_ids += delta.token_ids
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
