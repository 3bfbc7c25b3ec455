"""Prometheus counters of the data-parallel router, on the frontend's registry.

    kvflow:router_requests_total{model_name, engine, policy}   requests routed
    kvflow:router_prefix_hits_total{model_name, engine}        routed by a known prefix

Every (engine, policy) series exists at 0 from the start, so a rate() over a fresh
server is 0 and not absent. `policy` is the rule that decided: the configured one,
"least-load" (prefix-aware's fallback) or "rank" (an explicit data_parallel_rank).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from kvflow.routing import Decision

POLICIES = ("prefix-aware", "least-load", "round-robin", "rank")


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, num_engines: int) -> None:
        self.model_name = model_name
        self.routed = Counter(
            "kvflow:router_requests",
            "Requests routed to an engine, by engine and deciding policy.",
            ["model_name", "engine", "policy"],
            registry=registry,
        )
        self.prefix_hits = Counter(
            "kvflow:router_prefix_hits",
            "Requests routed to the engine holding their longest known prefix.",
            ["model_name", "engine"],
            registry=registry,
        )
        for engine in map(str, range(num_engines)):
            self.prefix_hits.labels(model_name, engine)
            for policy in POLICIES:
                self.routed.labels(model_name, engine, policy)

    def observe(self, engine: str, decision: Decision) -> None:
        self.routed.labels(self.model_name, engine, decision.policy).inc()
        if decision.prefix_hit:
            self.prefix_hits.labels(self.model_name, engine).inc()
