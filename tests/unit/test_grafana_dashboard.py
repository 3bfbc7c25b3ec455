"""The Grafana dashboard (docker/grafana/) against the metrics the frontend exports.

Grafana itself is not installable here; these checks keep the JSON in step with
`kvflow.services.frontend.metrics`, and tests/compose runs every panel's PromQL against
a real Prometheus.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvflow.services.frontend.metrics import FrontendMetrics

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "docker" / "grafana"
DASHBOARD = GRAFANA / "kvflow-dashboard.json"
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
METRIC = re.compile(r"kvflow:[A-Za-z0-9_:]+")
VARIABLE = re.compile(r"\$\{?(\w+)\}?")
# The series a metric family exports, by its type (the `_created` series are not charted).
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported_families() -> dict[str, tuple[str, ...]]:
    """Family name -> the series names it exports, read off the frontend's registry."""
    metrics = FrontendMetrics("model", max_model_len=2048)
    return {
        family.name: tuple(family.name + suffix for suffix in SUFFIXES[family.type])
        for registry in (metrics.registry, metrics.process_registry)
        for family in registry.collect()
    }


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def charts() -> list[dict[str, Any]]:
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]


def expressions() -> list[str]:
    return [target["expr"] for panel in charts() for target in panel["targets"]]


def test_frontend_exports_the_families_the_dashboard_is_built_for() -> None:
    families = exported_families()
    assert "kvflow:time_to_first_token_seconds" in families
    assert families["kvflow:request_success"] == ("kvflow:request_success_total",)
    assert families["kvflow:kv_cache_usage_perc"] == ("kvflow:kv_cache_usage_perc",)


def test_panels_have_unique_ids_and_fit_the_grid() -> None:
    panels = dashboard()["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]


@pytest.mark.parametrize("panel", charts(), ids=lambda panel: panel["title"])
def test_every_panel_has_promql_targets(panel: dict[str, Any]) -> None:
    targets = panel["targets"]
    assert targets, "a panel without a query shows nothing"
    assert len({target["refId"] for target in targets}) == len(targets)
    for target in targets:
        assert target["datasource"]["type"] == "prometheus"
        expr = target["expr"]
        assert METRIC.search(expr), f"{target['refId']} names no kvflow metric: {expr}"
        for opening, closing in ("()", "[]", "{}"):
            assert expr.count(opening) == expr.count(closing), expr


def test_every_metric_a_panel_names_is_exported() -> None:
    exported = {name for names in exported_families().values() for name in names}
    named = {name for expr in expressions() for name in METRIC.findall(expr)}
    assert named - exported == set()


def test_every_exported_family_is_charted() -> None:
    named = {name for expr in expressions() for name in METRIC.findall(expr)}
    uncharted = [
        family
        for family, series in exported_families().items()
        if not any(name in named for name in series)
    ]
    assert uncharted == []


def test_every_variable_is_defined() -> None:
    defined = {variable["name"] for variable in dashboard()["templating"]["list"]}
    for expr in expressions():
        for name in VARIABLE.findall(expr):
            assert name in defined | GRAFANA_BUILTINS, f"${name} in {expr}"
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["allValue"] == ".*"  # "All" must match every label value
            assert METRIC.search(variable["definition"])


def test_provisioning_points_at_the_dashboard_and_its_datasource() -> None:
    provisioning = GRAFANA / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    variable = next(v for v in dashboard()["templating"]["list"] if v["type"] == "datasource")
    assert source["uid"] == variable["current"]["value"]
    assert source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((provisioning / "dashboards" / "kvflow.yaml").read_text())
    (provider,) = providers["providers"]
    grafana = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["grafana"]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in grafana["volumes"]}
    dashboard_mount = f"{provider['options']['path']}/{DASHBOARD.name}"
    assert mounts[dashboard_mount] == "./docker/grafana/kvflow-dashboard.json"
    assert mounts["/etc/grafana/provisioning"] == "./docker/grafana/provisioning"
