"""The scheduler side of KV connectors (disaggregated prefill/decode)."""
