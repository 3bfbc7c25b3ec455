"""The per-step encoder budget: how many image features a step may compute.

Running the vision tower is work the token budget does not see: a step whose prefill
reaches eight new images encodes all eight before its forward. This feature caps the
image features computed per step at `max_num_encoder_input_tokens` (default: the token
budget). Each request's chunk is looked at as the scheduler sizes it (`cap_tokens`):

    prompt  [text ...... | image A run | text | image B run | ...]
             computed ^    chunk ......................^
    for each image run the chunk reaches, in order:
      features already computed (mirror below) or being computed this step -> free
      fits what is left of this step's budget                              -> charged
      else                   -> the chunk ends before the run; nothing later in
                                this step encodes (images go in arrival order)

So an image that does not fit waits for a later step while decodes and text prefill go
on; its request keeps its place. An image larger than the whole budget is admitted
alone: in a step that has encoded nothing else (never refused; the effect of raising the
budget to the largest image, as other servers do).

Which features exist is a mirror of the worker's encoder cache (image_feature.py): an
LRU of image hashes holding at most `encoder_cache_size` features, touched as steps are
planned. The worker's cache is sized in bytes (256 MiB by default) and is far larger in
practice than the mirror, so whatever the mirror holds the worker holds; were it not, the
worker encodes the image again (one step over budget, never a wrong output).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvflow.services.scheduler.request import Request
from kvflow.services.scheduler.step_features import StepBuilder, StepFeature


@dataclass
class _Charge:
    """One request's encoder work in the step being planned."""

    num_tokens: int = 0  # features it encodes
    encodes: list[str] = field(default_factory=list)  # hashes it encodes
    reads: dict[str, int] = field(default_factory=dict)  # hash -> length: every run it reaches


class EncoderCacheMirror:
    """image hash -> features count; least recently used out past `max_tokens`."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, int] = OrderedDict()
        self._tokens = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def touch(self, key: str, length: int) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = length
        self._tokens += length
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._tokens -= old


class EncoderBudgetFeature(StepFeature):
    def __init__(self, max_tokens: int, cache_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.cache = EncoderCacheMirror(cache_tokens)
        self._step: StepBuilder | None = None
        self._charges: dict[str, _Charge] = {}  # req_id -> its charge this step
        self._closed = False  # an image waited: no more encoding this step
        self.last_step_tokens = 0  # features the last planned step encodes
        self.num_deferred = 0  # chunks cut before an image (cumulative)

    def begin_step(self, step: StepBuilder) -> None:
        self._step = step
        self._charges = {}
        self._closed = False

    def cap_tokens(self, request: Request, num_new: int) -> int:
        if not request.images or self._step is None:
            return num_new
        # Only requests still in the plan count (a preempted one gave its charge back).
        live = [c for r, c in self._charges.items() if r in self._step.scheduled]
        spent = sum(c.num_tokens for c in live)
        encoding = {h for c in live for h in c.encodes}
        start = request.num_computed_tokens
        charge = _Charge()
        for image in request.images:
            if image.offset >= start + num_new:
                break
            if image.offset + image.length <= start:
                continue
            free = image.hash in self.cache or image.hash in encoding
            if not free and image.hash not in charge.encodes:
                used = spent + charge.num_tokens
                alone = used == 0 and not self._closed
                if self._closed or (used + image.length > self.max_tokens and not alone):
                    self._closed = True
                    self.num_deferred += 1
                    num_new = image.offset - start
                    break
                charge.num_tokens += image.length
                charge.encodes.append(image.hash)
            charge.reads[image.hash] = image.length
        self._charges[request.request_id] = charge
        return num_new

    def end_step(self, step: StepBuilder) -> None:
        self.last_step_tokens = 0
        for req_id, charge in self._charges.items():
            if req_id in step.scheduled:
                self.last_step_tokens += charge.num_tokens
                for key, length in charge.reads.items():
                    self.cache.touch(key, length)
        self._charges = {}
        self._step = None
