"""Request-level metrics summed over several API servers (`--api-server-count` > 1).

Each API server process counts the requests it served (HTTP requests, TTFT, ITL,
finished requests, routing decisions) in its own registry, while every one of them sees
every engine's stats. A scrape reaches whichever process the kernel picks, so without
this the request-level series would show that process's share and read as resets.

So each process writes a snapshot of its per-process families to
`<metrics_dir>/<frontend id>.json` (atomically, every `PUBLISH_S` and on each scrape),
and a scrape answers with the engine-level families of the scraped process once, plus
the per-process families summed over every fresh snapshot: counters, histogram buckets,
sums and counts, and gauges add; `_created` takes the earliest. A snapshot older than
`STALE_S` (a process that died) is left out.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

PUBLISH_S = 1.0
STALE_S = 10.0

Snapshot = list[dict[str, Any]]  # [{"name", "documentation", "type", "samples": [...]}]


def snapshot(registry: CollectorRegistry) -> Snapshot:
    families = []
    for family in registry.collect():
        samples = [[s.name, s.labels, s.value] for s in family.samples]
        families.append(
            {"name": family.name, "documentation": family.documentation,
             "type": family.type, "samples": samples}
        )  # fmt: skip
    return families


def merge(snapshots: list[Snapshot]) -> list[Metric]:
    """One family per name; samples with equal name and labels summed (`_created`: min)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for families_of_one in snapshots:
        for family in families_of_one:
            name = family["name"]
            if name not in families:
                families[name] = Metric(name, family["documentation"], family["type"])
                values[name] = {}
            merged = values[name]
            for sample_name, labels, value in family["samples"]:
                key = (sample_name, tuple(sorted(labels.items())))
                if key not in merged:
                    merged[key] = value
                elif sample_name.endswith("_created"):
                    merged[key] = min(merged[key], value)
                else:
                    merged[key] += value
    for name, metric in families.items():
        for (sample_name, labels), value in values[name].items():
            metric.add_sample(sample_name, dict(labels), value)
    return list(families.values())


class _Merged:
    """A collector that yields already merged families."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class SharedProcessMetrics:
    """This API server's share, published for its siblings, and the sum of them all."""

    def __init__(self, directory: Path, frontend_id: str, registry: CollectorRegistry) -> None:
        self.directory = directory
        self.path = directory / f"{frontend_id}.json"
        self.registry = registry
        directory.mkdir(parents=True, exist_ok=True)

    def publish(self) -> None:
        temporary = self.path.with_suffix(f".tmp{os.getpid()}")
        temporary.write_text(json.dumps(snapshot(self.registry)))
        os.replace(temporary, self.path)  # a reader never sees half a file

    def withdraw(self) -> None:
        self.path.unlink(missing_ok=True)

    def render(self) -> bytes:
        """The per-process families summed over every live API server."""
        self.publish()
        now = time.time()
        snapshots = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                if now - path.stat().st_mtime > STALE_S:
                    continue
                snapshots.append(json.loads(path.read_text()))
            except (OSError, ValueError):  # withdrawn or replaced meanwhile
                continue
        merged = CollectorRegistry(auto_describe=False)
        merged.register(_Merged(merge(snapshots)))  # type: ignore[arg-type]
        return generate_latest(merged)
