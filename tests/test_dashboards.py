"""Every metric named in the Grafana dashboards is one the services really export, with the labels its selectors,
groupings and legends name; every series a panel draws has a legend that tells it apart."""

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
SELECTOR = re.compile(r"\b(specmesh_[a-z0-9_]+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r"([a-z_]+)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")
LEGEND_LABEL = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")
SERVICES = ("gateway", "worker", "detokenizer")
# Labels Prometheus puts on every scraped series (the target's), and a histogram's bucket bound.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "service", "endpoint"})
BUCKET_LABEL = "le"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _exported() -> set[str]:
    for service in SERVICES:
        NatsMetrics.for_service(service)
    return set(REGISTRY._names_to_collectors)  # every sample name: _total, _bucket, _count, ...


def _expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def _labels(sample_name: str) -> frozenset[str]:
    """The labels a sample name carries: its metric's own, the target's, and le on a histogram's buckets."""
    collector = REGISTRY._names_to_collectors[sample_name]
    own = frozenset(collector._labelnames) | TARGET_LABELS
    return own | {BUCKET_LABEL} if sample_name.endswith("_bucket") else own


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


def test_no_metric_label_is_one_the_scrape_sets() -> None:
    """A scraped label named like a target's is renamed exported_<name>, and queries for it find nothing."""
    _exported()
    for name, collector in REGISTRY._names_to_collectors.items():
        if name.startswith("specmesh_"):
            assert not set(collector._labelnames) & TARGET_LABELS, f"{name}: {collector._labelnames}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_selectors_groupings_and_legends_name_labels_the_metrics_carry(path: Path) -> None:
    _exported()
    for panel in json.loads(path.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr, legend = target["expr"], target.get("legendFormat", "")
            selectors = SELECTOR.findall(expr)
            carried = frozenset().union(*(_labels(name) for name, _ in selectors))
            for name, matchers in selectors:
                unknown = set(MATCHER.findall(matchers)) - _labels(name)
                assert not unknown, f"{panel['title']}: {name} has no label {sorted(unknown)}"
            grouped = {label.strip() for clause in GROUPING.findall(expr) for label in clause.split(",")} - {""}
            assert grouped <= carried, f"{panel['title']}: groups by {sorted(grouped - carried)}, which {expr} lacks"
            # What the query returns per series: the grouping's labels but le (histogram_quantile consumes it).
            drawn = grouped - {BUCKET_LABEL}
            shown = set(LEGEND_LABEL.findall(legend))
            assert shown <= drawn, f"{panel['title']}: the legend {legend!r} names {sorted(shown - drawn)}"
            assert drawn <= shown, f"{panel['title']}: the legend {legend!r} does not tell {sorted(drawn)} apart"
