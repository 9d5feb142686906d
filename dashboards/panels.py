"""Grafana building blocks on grafana-foundation-sdk: boards, variables, panels, targets.

Every panel is made here so that every panel has a title, a description, a unit and
the Prometheus datasource with its fixed uid, and every board has the same `job` /
`instance` / `model_name` variables and links to its siblings.  Panel ids are assigned
in order, so the JSON is stable from one generation to the next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

from dashboards import promql

PROMETHEUS_UID = "prometheus"
PROM = dm.DataSourceRef(type_val="prometheus", uid=PROMETHEUS_UID)
TAG = "sightline"
QUANTILES = (0.5, 0.9, 0.99)
# (name, label, the query its values come from)
VARIABLES = (
    ("job", "job", "label_values(sightline_build_info, job)"),
    ("instance", "instance", 'label_values(sightline_build_info{job=~"$job"}, instance)'),
    ("model_name", "model", 'label_values(sightline_build_info{job=~"$job", instance=~"$instance"}, model_name)'),
)

Target = tuple[str, str]  # (expr, legend)


def _variable(name: str, label: str, query: str) -> db.QueryVariable:
    return (
        db.QueryVariable(name)
        .label(label)
        .query(query)
        .datasource(PROM)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dm.VariableOption(selected=True, text="All", value="$__all"))
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
    )


def _targets(panel, targets: list[Target], exemplar: str = ""):
    """Targets A, B, ...; `exemplar` names the one whose exemplars (trace ids) are shown."""
    for i, (expr, legend) in enumerate(targets):
        ref = chr(ord("A") + i)
        q = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(PROM).range()
        panel = panel.with_target(q.exemplar(True) if ref == exemplar else q)
    return panel


def timeseries_panel(
    title: str,
    description: str,
    unit: str,
    targets: list[Target],
    *,
    stack: bool = False,
    exemplar: str = "",
    width: int = 12,
    height: int = 8,
    right: dict[str, str] | None = None,
    max_value: float | None = None,
):
    """A time series; `right` maps a target's refId to the unit of a second (right) axis."""
    p = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(PROM)
        .span(width)
        .height(height)
        .fill_opacity(40 if stack else 10)
        .line_width(1)
        .legend(
            cb.VizLegendOptions()
            .display_mode(cm.LegendDisplayMode.LIST)
            .placement(cm.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
    )
    if stack:
        p = p.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
    if max_value is not None:
        p = p.min(0).max(max_value)
    for ref, right_unit in (right or {}).items():
        p = p.override_by_query(
            ref,
            [
                dm.DynamicConfigValue(id_val="unit", value=right_unit),
                dm.DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
            ],
        )
    return _targets(p, targets, exemplar)


def stat_panel(
    title: str,
    description: str,
    unit: str,
    targets: list[Target],
    *,
    width: int = 6,
    height: int = 4,
    decimals: int = 3,
):
    p = (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(PROM)
        .span(width)
        .height(height)
        .decimals(decimals)
        .graph_mode(cm.BigValueGraphMode.AREA)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    return _targets(p, targets)


def latency_panel(
    title: str,
    description: str,
    histogram: str,
    *matchers: str,
    by: tuple[str, ...] = (),
    with_mean: bool = True,
    width: int = 12,
):
    """p50 / p90 / p99 (and the mean) of a histogram; exemplars on p99: a slow point opens its trace."""
    suffix = "".join(f" {{{{{b}}}}}" for b in by)
    targets = [(promql.quantile(q, histogram, *matchers, by=by), f"p{round(q * 100)}{suffix}") for q in QUANTILES]
    if with_mean:
        targets.append((promql.mean(histogram, *matchers, by=by), f"mean{suffix}"))
    return timeseries_panel(title, description, "s", targets, exemplar="C", width=width)


class _PromAnnotation(dm.AnnotationQuery):
    """A Prometheus annotation query: the SDK's model lacks the Prometheus fields (title and text
    templates, tag labels), so they are added to its JSON here."""

    def __init__(self, title_format: str, text_format: str, tag_keys: str, **kw) -> None:
        super().__init__(**kw)
        self.title_format, self.text_format, self.tag_keys = title_format, text_format, tag_keys

    def build(self) -> "_PromAnnotation":  # what the dashboard builder takes
        return self

    def to_json(self) -> dict[str, object]:
        return {
            **super().to_json(),
            "titleFormat": self.title_format,
            "textFormat": self.text_format,
            "tagKeys": self.tag_keys,
            "useValueForTime": False,
        }


def annotation(
    name: str, expr: str, title: str, text: str, tag_keys: tuple[str, ...], color: str
) -> dm.AnnotationQuery:
    """An annotation from a Prometheus query: a mark wherever `expr` has a sample, labelled by `title`
    (`{{label}}` templates) and tagged with the values of `tag_keys`."""
    return _PromAnnotation(
        title,
        text,
        ",".join(tag_keys),
        name=name,
        datasource=PROM,
        enable=True,
        hide=False,
        icon_color=color,
        expr=expr,
    )


@dataclass
class Board:
    """One dashboard: rows of panels, numbered in order, and its annotation queries."""

    uid: str
    title: str
    description: str
    rows: list[tuple[str, list]] = field(default_factory=list)
    annotations: list[dm.AnnotationQuery] = field(default_factory=list)

    def row(self, title: str, *panels) -> "Board":
        self.rows.append((title, list(panels)))
        return self

    def annotate(self, *queries: dm.AnnotationQuery) -> "Board":
        self.annotations.extend(queries)
        return self

    def build(self) -> dm.Dashboard:
        b = (
            db.Dashboard(self.title)
            .uid(self.uid)
            .description(self.description)
            .tags([TAG])
            .time("now-1h", "now")
            .refresh("30s")
            .timezone("browser")
            .editable()
            .tooltip(dm.DashboardCursorSync.CROSSHAIR)
            .link(
                db.DashboardLink("Sightline dashboards")
                .type(dm.DashboardLinkType.DASHBOARDS)
                .tags([TAG])
                .as_dropdown(True)
                .include_vars(True)
                .keep_time(True)
            )
        )
        for name, label, query in VARIABLES:
            b = b.with_variable(_variable(name, label, query))
        for query in self.annotations:
            b = b.annotation(query)
        next_id = 1
        for title, panels in self.rows:
            b = b.with_row(db.Row(title).id(next_id))
            next_id += 1
            for panel in panels:
                b = b.with_panel(panel.id(next_id))
                next_id += 1
        return b.build()


def to_json(board: Board) -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(board.build()) + "\n"
