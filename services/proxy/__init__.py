"""`kvflow proxy`: one OpenAI-compatible front for disaggregated prefill and decode."""
