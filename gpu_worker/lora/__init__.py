"""Multi-LoRA serving on the worker: adapter slots on the projections, the host cache,
and the per-step row -> slot mapping (see docs/lora.md)."""
