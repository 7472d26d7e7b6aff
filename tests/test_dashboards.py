"""Every metric named in the Grafana dashboards is one the services really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.registry import REGISTRY

import services.detokenizer.service  # noqa: F401  (registers the detokenizer's metrics)
import services.gateway.metrics  # noqa: F401
import services.worker.metrics  # noqa: F401
from shared.observability import NatsMetrics

DASHBOARDS = sorted((Path(__file__).parent.parent / "k8s" / "base" / "dashboards").glob("*.json"))
METRIC = re.compile(r"\bspecmesh_[a-z0-9_]+")
SERVICES = ("gateway", "worker", "detokenizer")


def _exported() -> set[str]:
    for service in SERVICES:
        NatsMetrics.for_service(service)
    return set(REGISTRY._names_to_collectors)  # every sample name: _total, _bucket, _count, ...


def _expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def test_both_dashboards_exist() -> None:
    assert [p.name for p in DASHBOARDS] == ["specmesh-overview.json", "specmesh-speculative.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_metric_in_every_expression_is_exported(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    exprs = _expressions(dashboard)
    assert exprs, f"{path.name} has no queries"
    exported = _exported()
    unknown = {name for expr in exprs for name in METRIC.findall(expr)} - exported
    assert not unknown, f"{path.name} queries metrics no service exports: {sorted(unknown)}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_panels_have_unique_ids_and_titles(path: Path) -> None:
    panels = json.loads(path.read_text())["panels"]
    assert len({p["id"] for p in panels}) == len({p["title"] for p in panels}) == len(panels)
