"""The worker side of KV connectors: moving KV blocks in and out of the paged cache."""
