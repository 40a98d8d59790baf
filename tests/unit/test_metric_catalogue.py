"""The metric names operators rely on cannot drift (issue 31): every metric that the Prometheus
rules (``deploy/prometheus/alerts.yml``) and the Grafana dashboard
(``deploy/grafana/epd-pipeline.json``) name is one the code exports, every recording rule they
use is defined, and the README's metric table lists exactly the exported metrics, with their
type, labels and endpoint.

What the code exports is read from the metric classes themselves, each instantiated into a fresh
``CollectorRegistry``: the sample names (``_total``, ``_bucket``...) are the ones
prometheus_client writes, not ones this test spells.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from consumers.metrics import ConsumerMetrics
from frontend.api.metrics import Metrics
from gpu_workers.metrics import EncodeMetrics
from runtime.fleet.metrics import FleetMetrics

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "epd-pipeline.json"
PRODUCT = ("frontend", "producers", "consumers", "gpu_workers", "media", "runtime", "epd")


def _api(_: CollectorRegistry) -> tuple[object, CollectorRegistry]:
    metrics = Metrics()  # the API app's own registry
    return metrics, metrics.registry


def _into(cls: Callable[[CollectorRegistry], object]) -> Callable[..., Any]:
    return lambda registry: (cls(registry), registry)


SOURCES: tuple[tuple[str, Callable[[CollectorRegistry], tuple[object, CollectorRegistry]]], ...] = (
    ("API", _api),
    ("API (fleet)", _into(FleetMetrics)),
    ("worker", _into(ConsumerMetrics)),
    ("encode worker", _into(EncodeMetrics)),
)
"""Each metric class and the ``/metrics`` that serves it, as the README's table says: the API's
(fleet series included, measured from the broker and Redis at scrape time), every worker's
``--metrics-port``, the encode workers' only."""


@dataclass(frozen=True)
class Family:
    """One exported metric: its type, labels, the endpoint serving it, its sample names."""

    name: str
    type: str
    labels: tuple[str, ...]
    where: str
    samples: frozenset[str]

    @property
    def queried_as(self) -> str:
        """The name the README lists: a counter's ``_total`` sample, else the family name."""
        return f"{self.name}_total" if self.type == "counter" else self.name


def exported() -> dict[str, Family]:
    """Every metric family the code's metric classes register, by family name."""
    families: dict[str, Family] = {}
    for where, build in SOURCES:
        holder, registry = build(CollectorRegistry())
        for metric in vars(holder).values():
            # A labelled metric yields no sample until it has a child; one with placeholder
            # values makes the registry write its samples (prometheus_client keeps the label
            # names only in _labelnames).
            if isinstance(metric, MetricWrapperBase) and metric._labelnames:
                metric.labels(*("x" for _ in metric._labelnames))
        for fam in registry.collect():
            labels = sorted({k for s in fam.samples for k in s.labels} - {"le"})
            samples = frozenset(s.name for s in fam.samples)
            families[fam.name] = Family(fam.name, fam.type, tuple(labels), where, samples)
    return families


def exported_samples() -> set[str]:
    """Every sample name the code exports (what a PromQL selector can name)."""
    return {s for fam in exported().values() for s in fam.samples}


# --- names in PromQL ----------------------------------------------------------------------

FUNCTIONS = frozenset(
    # Aggregation operators.
    "sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk "
    "limit_ratio "
    # Functions.
    "abs absent absent_over_time ceil changes clamp clamp_max clamp_min day_of_month "
    "day_of_week day_of_year days_in_month delta deriv double_exponential_smoothing exp floor "
    "histogram_avg histogram_count histogram_fraction histogram_quantile histogram_stddev "
    "histogram_stdvar histogram_sum hour idelta increase info irate label_join label_replace ln "
    "log2 log10 minute month predict_linear rate resets round scalar sgn sort sort_desc "
    "sort_by_label sort_by_label_desc sqrt time timestamp vector year avg_over_time "
    "min_over_time max_over_time sum_over_time count_over_time quantile_over_time "
    "stddev_over_time stdvar_over_time last_over_time present_over_time mad_over_time "
    "acos acosh asin asinh atan atanh cos cosh sin sinh tan tanh deg pi rad start end".split()
)
"""PromQL's aggregations and functions: an identifier before ``(`` must be one of these."""
KEYWORDS = frozenset(
    "by without on ignoring group_left group_right bool offset and or unless atan2 inf nan".split()
)
"""PromQL's keywords and binary operators spelled as words (``inf``/``nan`` in any case)."""

_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKENS = re.compile(r"(?<![\w.:])(\d[\w.]*|[A-Za-z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric (and recording-rule) names a PromQL expression selects: the identifiers left
    once strings, label matchers, ranges, label lists, Grafana variables, numbers, durations,
    keywords and function calls are set aside. A call of an unknown function is a ValueError
    (a typo would otherwise read as a metric name, or pass)."""
    text = _STRINGS.sub(" ", expr)  # label values, label_replace's arguments: never names
    text = re.sub(r"#[^\n]*", " ", text)  # comments
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers (no strings left to hide a brace)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries, $__rate_interval included
    text = _LABEL_LISTS.sub(" ", text)  # by (...), on (...), group_left (...): label names
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables elsewhere
    names = set()
    for match in _TOKENS.finditer(text):
        token, call = match.group(1), match.group(2)
        if token[0].isdigit():
            continue  # a number or a duration: 0.99, 1e3, 0x1f, 5m, 1h30m
        if token.lower() in KEYWORDS:
            continue  # before a parenthesis too: `x unless on (a) (y)` leaves `unless (y)`
        if call:
            if token not in FUNCTIONS:
                raise ValueError(f"unknown PromQL function {token!r} in {expr!r}")
            continue
        names.add(token)
    return names


def unknown_names(expr: str, exported: set[str], records: set[str]) -> set[str]:
    """Names in ``expr`` that are neither exported samples nor defined recording rules (a name
    with a colon is a recording rule's, by Prometheus's naming convention)."""
    return {n for n in metric_names(expr) if n not in (records if ":" in n else exported)}


SCRAPE_LABELS = frozenset({"job", "instance", "le", "__name__"})
"""Labels a series has without the code naming them: the scrape's, a bucket's, the name."""
_LIST_BODIES = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def label_names(expr: str) -> set[str]:
    """The label names an expression matches on or groups by: those in ``{...}`` matchers and
    in ``by``/``without``/``on``/``ignoring``/``group_left``/``group_right`` lists."""
    text = _STRINGS.sub('""', expr)  # a value keeps its place after `=`, its text is gone
    names = set()
    for body in re.findall(r"\{([^}]*)\}", text):
        names |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body))
    for body in _LIST_BODIES.findall(text):
        names |= {n.strip() for n in body.split(",") if n.strip()}
    return names


def unknown_labels(expr: str, families: dict[str, Family]) -> set[str]:
    """Labels in ``expr`` that no exported metric carries (nor a scrape adds)."""
    known = SCRAPE_LABELS.union(*(f.labels for f in families.values()))
    return label_names(expr) - known


# --- the files ----------------------------------------------------------------------------


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def recording_rules() -> set[str]:
    """The recording rules alerts.yml defines."""
    return {r["record"] for r in _rules() if "record" in r}


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside rows included."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))  # a collapsed row holds its panels


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard, parsed."""
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def expressions() -> list[tuple[str, str]]:
    """(where, expr) of every rule in alerts.yml and every target of the dashboard."""
    found = [(r.get("record") or r["alert"], r["expr"]) for r in _rules()]
    for panel in all_panels(dashboard()["panels"]):
        found += [(f"panel {panel['title']!r}", t["expr"]) for t in panel.get("targets", [])]
    return found


# --- tests --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'sum by (group) (rate(epd_consumer_dead_lettered_total{group=~"epd-.*"}[5m]))'
            " / on (group) group_left sum(rate(other_total[5m] offset 1h))",
            {"epd_consumer_dead_lettered_total", "other_total"},
        ),
        (
            "histogram_quantile(0.99, sum without (instance) "
            "(rate(epd_consumer_handler_seconds_bucket[$__rate_interval])))",
            {"epd_consumer_handler_seconds_bucket"},
        ),
        (
            'absent(epd_fleet_workers{stage="encode"}) or epd_fleet_workers == bool 0',
            {"epd_fleet_workers"},
        ),
        (
            'label_replace(epd:group_lag:sum > 0, "stage", "$1", "group", ".*-(by|sum)")'
            " unless on (stage) (epd:fleet_workers:max > 0)",
            {"epd:group_lag:sum", "epd:fleet_workers:max"},
        ),
        ("max_over_time(a_metric[10m:1m]) * 1e3 + 0x1f - .5 > Inf", {"a_metric"}),
        ("sum(x) by (group, le) and y offset 1h30m # trailing comment naming z", {"x", "y"}),
        ('{__name__="hidden"} or count by (on) (sum_total)', {"sum_total"}),
    ],
)
def test_metric_names_reads_the_names_out_of_tricky_expressions(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_metric_names_refuses_an_unknown_function() -> None:
    with pytest.raises(ValueError, match="'rat'"):
        metric_names("rat(epd_api_requests_total[5m])")


def test_the_catalogue_holds_what_the_classes_register() -> None:
    families = exported()
    assert families["epd_api_requests"].samples == {
        "epd_api_requests_total",
        "epd_api_requests_created",
    }
    assert families["epd_api_requests"].labels == ("status",)
    handler = families["epd_consumer_handler_seconds"]
    assert handler.type == "histogram" and handler.labels == ("group",)
    assert {f"epd_consumer_handler_seconds_{s}" for s in ("bucket", "sum", "count")} <= set(
        handler.samples
    )
    assert families["epd_group_lag"].labels == ("group", "partition", "topic")


def test_every_expression_names_an_exported_metric_or_a_defined_recording_rule() -> None:
    samples, records = exported_samples(), recording_rules()
    exprs = expressions()
    assert len(exprs) > 20  # the files were read
    unknown = {where: bad for where, e in exprs if (bad := unknown_names(e, samples, records))}
    assert unknown == {}


@pytest.mark.parametrize(
    ("expr", "bad"),
    [
        ("rate(epd_consumer_processed[5m])", {"epd_consumer_processed"}),  # no _total
        ("epd_group_lag > 0 and epd_fleet_worker == 0", {"epd_fleet_worker"}),
        ("deriv(epd:group_lag:max[10m])", {"epd:group_lag:max"}),  # no such recording rule
        ("histogram_quantile(0.5, rate(epd_api_render_seconds[5m]))", {"epd_api_render_seconds"}),
    ],
)
def test_a_name_the_code_does_not_export_is_caught(expr: str, bad: set[str]) -> None:
    assert unknown_names(expr, exported_samples(), recording_rules()) == bad


def test_every_label_an_expression_names_is_one_the_metrics_carry() -> None:
    families = exported()
    unknown = {where: bad for where, e in expressions() if (bad := unknown_labels(e, families))}
    assert unknown == {}


@pytest.mark.parametrize(
    ("expr", "bad"),
    [
        ("sum by (grup) (rate(epd_consumer_processed_total[5m]))", {"grup"}),
        ('epd_fleet_workers{stag="encode", job=~"a|b"}', {"stag"}),
        ('x / on (stage, reason) group_left (modle) y{reason!="{by (z)}"}', {"modle"}),
    ],
)
def test_a_label_no_metric_carries_is_caught(expr: str, bad: set[str]) -> None:
    assert unknown_labels(expr, exported()) == bad


def test_every_recording_rule_is_used_and_follows_the_naming_convention() -> None:
    records = recording_rules()
    used = set().union(*(metric_names(e) for _, e in expressions()))
    assert records <= used, f"defined, never used: {records - used}"
    for name in records:
        # epd:WHAT:HOW (rate5m, sum, max, ratio): the colons mark a rule for metric_names.
        assert re.fullmatch(r"epd:[a-z_]+:[a-z0-9_]+", name), name


def test_the_dashboard_asks_for_its_prometheus_and_names_no_datasource_uid() -> None:
    dash = dashboard()
    assert dash["schemaVersion"] >= 39  # Grafana 11 and later
    [var] = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert var["name"] == "datasource" and var["query"] == "prometheus"
    everything = list(all_panels(dash["panels"]))
    assert len({p["id"] for p in everything}) == len(everything)
    for panel in (p for p in everything if p["type"] != "row"):
        assert panel["targets"], panel["title"]
        for owner in (panel, *panel["targets"]):
            assert owner["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


# --- the README's table -------------------------------------------------------------------

_ROW = re.compile(r"^\| `(epd_\w+)` \| (\w+) \| ([^|]*) \| ([^|]*) \| [^|]+ \|$", re.MULTILINE)


def readme_table(text: str) -> dict[str, tuple[str, tuple[str, ...], str]]:
    """The README's metric table: name -> (type, labels, endpoint)."""
    rows = {}
    for name, kind, labels, where in _ROW.findall(text):
        assert name not in rows, f"{name} listed twice"
        rows[name] = (kind, tuple(sorted(re.findall(r"`(\w+)`", labels))), where.strip())
    return rows


def catalogue_table() -> dict[str, tuple[str, tuple[str, ...], str]]:
    """What the README's table must say, from the code."""
    return {f.queried_as: (f.type, f.labels, f.where) for f in exported().values()}


def test_the_readme_table_lists_exactly_the_exported_metrics() -> None:
    assert readme_table((ROOT / "README.md").read_text()) == catalogue_table()


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.replace("| `epd_dlq_records` |", "| `epd_dlq_recordz` |"),  # misspelt
        lambda t: re.sub(r"^\| `epd_store_max_bytes` .*\n", "", t, flags=re.MULTILINE),  # gone
        lambda t: t.replace("`group`, `topic`, `partition` |", "`group`, `topic` |", 1),
        lambda t: t.replace("| `epd_api_in_flight` | gauge |", "| `epd_api_in_flight` | counter |"),
    ],
    ids=["misspelt", "missing", "label-dropped", "wrong-type"],
)
def test_a_readme_table_that_drifts_from_the_code_is_caught(edit: Callable[[str], str]) -> None:
    text = (ROOT / "README.md").read_text()
    edited = edit(text)
    assert edited != text  # the edit found its row
    assert readme_table(edited) != catalogue_table()


def _metric_literals(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in {"Counter", "Gauge", "Histogram", "Summary"}
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value


def test_no_metric_is_defined_outside_the_catalogued_classes() -> None:
    # A metric class left out of SOURCES would be missing from the README and the name check.
    files = [p for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")]
    defined = {name for path in files for name in _metric_literals(path)}
    assert defined == set(exported())
