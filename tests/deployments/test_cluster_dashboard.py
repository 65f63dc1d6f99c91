"""The Grafana dashboard `cluster/grafana/qwen3_tts_dashboard.json`: valid panels on a Prometheus datasource
variable, every metric `deployments/metrics.py` defines in a query under its exported name, every Serve/node
metric known to the installed Ray, and bucket selectors that name buckets Ray exports.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from tests.deployments.cluster_files import DASHBOARD, METRICS_PY


def _defined_metrics() -> dict[str, str]:
    """name -> Counter | Gauge | Histogram, read from deployments/metrics.py (not hard-coded here)."""
    out = {}
    for node in ast.walk(ast.parse(METRICS_PY.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("Counter", "Gauge", "Histogram")):
            name = node.args[0] if node.args else next(k.value for k in node.keywords if k.arg == "name")
            assert isinstance(name, ast.Constant) and isinstance(name.value, str)
            out[name.value] = node.func.attr
    assert out, "no metric found in deployments/metrics.py"
    return out


def _prometheus_names(name: str, kind: str) -> set[str]:
    """What Ray's Prometheus endpoint exports for a metric: `ray_` prefix, `_total` on counters."""
    base = f"ray_{name}"
    return {"Counter": {f"{base}_total"}, "Gauge": {base},
            "Histogram": {f"{base}_bucket", f"{base}_sum", f"{base}_count"}}[kind]


def _ray_builtin_metrics() -> dict[str, str]:
    """Serve's and the node reporter's metrics in the installed Ray (f-string protocol names expanded)."""
    import ray

    pkg = Path(ray.__file__).parent
    sources = [*sorted((pkg / "serve").rglob("*.py")), pkg / "dashboard" / "modules" / "reporter" / "reporter_agent.py"]
    pattern = re.compile(r"\b(Counter|Gauge|Histogram)\(\s*(?:name=)?f?\"((?:serve|node)_[a-z_{}]+)\"")
    out = {}
    for source in sources:
        for kind, name in pattern.findall(source.read_text(encoding="utf-8", errors="replace")):
            for protocol in ("http", "grpc"):
                out[re.sub(r"\{[a-z_]+\}", protocol, name)] = kind
    return out


def _dashboard_queries(dashboard: dict) -> list[str]:
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    return queries


def test_dashboard_is_valid_and_uses_a_prometheus_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for target in p["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert target["expr"].count("{") == target["expr"].count("}"), target["expr"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24


def test_dashboard_queries_every_app_metric_by_its_exported_name():
    dashboard = json.loads(DASHBOARD.read_text())
    tokens = {t for q in _dashboard_queries(dashboard) for t in re.findall(r"\bray_[A-Za-z0-9_]+", q)}
    defined = _defined_metrics()
    valid = set().union(*(_prometheus_names(n, k) for n, k in defined.items()))
    for name, kind in defined.items():
        wanted = f"ray_{name}_bucket" if kind == "Histogram" else next(iter(_prometheus_names(name, kind)))
        assert wanted in tokens, f"{kind} {name} ({wanted}) is in no panel query"
    builtin = _ray_builtin_metrics()
    builtin_valid = set().union(*(_prometheus_names(n, k) for n, k in builtin.items()))
    for token in tokens:
        if token.startswith(("ray_serve_", "ray_node_")):
            assert token in builtin_valid, f"{token}: not a metric the installed Ray exports"
        else:
            assert token in valid, f"{token}: not exported by deployments/metrics.py (wrong suffix or stale)"
    assert {"ray_serve_deployment_queued_queries", "ray_serve_deployment_replica_healthy",
            "ray_serve_num_ongoing_requests_at_replicas"} <= tokens  # Serve's replica / queue view


def _histogram_boundaries() -> dict[str, list[float]]:
    """Exported bucket name -> the `le` bounds Ray exports for it (deployments/metrics.py's boundaries, +Inf)."""
    from unittest import mock

    from ray.serve import metrics as serve_metrics

    import deployments.metrics as app_metrics

    made: dict[str, list[float]] = {}

    def histogram(name, description="", boundaries=None, tag_keys=None):
        made[f"ray_{name}_bucket"] = [float(b) for b in boundaries]
        return mock.MagicMock()

    with mock.patch.object(serve_metrics, "Histogram", histogram), \
            mock.patch.object(serve_metrics, "Counter", mock.MagicMock()), \
            mock.patch.object(serve_metrics, "Gauge", mock.MagicMock()):
        app_metrics.IngressMetrics(), app_metrics.TalkerMetrics("m"), app_metrics.Code2WavMetrics()
    return made


def test_dashboard_bucket_selectors_name_buckets_ray_exports():
    """A `le="x"` selector names a series only when x is a boundary of that histogram ("Streams that ran dry"
    once selected le="0.0", a series no histogram had)."""
    boundaries = _histogram_boundaries()
    selectors = [(m, le) for q in _dashboard_queries(json.loads(DASHBOARD.read_text()))
                 for m, le in re.findall(r"\b(ray_[a-z0-9_]+_bucket)\{[^}]*\ble=\"([^\"]+)\"", q)]
    for metric, le in selectors:
        assert le == "+Inf" or float(le) in boundaries[metric], f'{metric}{{le="{le}"}} is not a series Ray exports'


def test_first_audio_buckets_resolve_the_served_range():
    boundaries = _histogram_boundaries()["ray_tts_time_to_first_audio_ms_bucket"]
    assert {5.0, 10.0, 15.0, 20.0, 30.0} <= set(boundaries) and boundaries == sorted(boundaries)


def test_dashboard_means_are_labelled_approximate():
    """Ray rebuilds a histogram's `_sum` from bucket midpoints: a mean from it is approximate, and says so."""
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        for target in p.get("targets", []):
            if "_sum{" in target["expr"]:
                assert "approx" in target["legendFormat"] or "approximate" in p["title"], (p["title"], target)
