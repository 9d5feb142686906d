"""PromQL for the dashboards, written one way.

Every selector gets the dashboard's `$job` / `$instance` (and `$model_name` where the
metric has that label, looked up in telemetry/metrics.py SPECS), every range is
`$__rate_interval`, and counters are only ever read through `rate`/`increase`: the
helpers make the lint rules true by construction, and tests/unit/test_dashboards.py checks
the output anyway.
"""

from __future__ import annotations

from telemetry.metrics import BY_NAME

RI = "$__rate_interval"
_SUFFIXES = ("_bucket", "_count", "_sum")


def has_model_label(metric: str) -> bool:
    base = metric
    for suffix in _SUFFIXES:
        if metric.endswith(suffix) and metric[: -len(suffix)] in BY_NAME:
            base = metric[: -len(suffix)]
    spec = BY_NAME.get(base)
    return spec is not None and "model_name" in spec.labels


def sel(metric: str, *matchers: str) -> str:
    ms = ['job=~"$job"', 'instance=~"$instance"']
    if has_model_label(metric):
        ms.append('model_name=~"$model_name"')
    return f"{metric}{{{', '.join([*ms, *matchers])}}}"


def _agg(agg: str, by: tuple[str, ...], inner: str) -> str:
    return f"{agg} by ({', '.join(by)}) ({inner})" if by else f"{agg}({inner})"


def rate(metric: str, *matchers: str, by: tuple[str, ...] = (), fn: str = "rate") -> str:
    """`sum by (...) (rate(metric{...}[$__rate_interval]))`."""
    return _agg("sum", by, f"{fn}({sel(metric, *matchers)}[{RI}])")


def gauge(metric: str, *matchers: str, by: tuple[str, ...] = (), agg: str = "sum") -> str:
    return _agg(agg, by, sel(metric, *matchers))


def quantile(q: float, histogram: str, *matchers: str, by: tuple[str, ...] = ()) -> str:
    return f"histogram_quantile({q}, {rate(histogram + '_bucket', *matchers, by=('le', *by))})"


def mean(histogram: str, *matchers: str, by: tuple[str, ...] = ()) -> str:
    return f"{rate(histogram + '_sum', *matchers, by=by)}\n/\n{rate(histogram + '_count', *matchers, by=by)}"


def counter_ratio(numerator: str, denominator: str, by: tuple[str, ...] = ()) -> str:
    """Rate of one counter ÷ rate of another (a cache's hits ÷ lookups); no data while the second is flat."""
    return f"{rate(numerator, by=by)}\n/\n{rate(denominator, by=by)}"


def ratio(counter: str, bad: str, by: tuple[str, ...] = ()) -> str:
    """Share of a counter's increase that matches `bad`; 0 (not "no data") when none do."""
    total = rate(counter, by=by)
    return f"(\n  {rate(counter, bad, by=by)}\n  or 0 * {total}\n)\n/\n{total}"


def per_peak(counter: str, peak: str, by: tuple[str, ...] = ("instance", "dp_rank")) -> str:
    """Rate of a counter ÷ a measured peak gauge of the same series (`by`); no data where the peak is 0."""
    on = ", ".join(by)
    return f"{rate(counter, by=by)}\n/ on ({on})\n({gauge(peak, by=by, agg='max')} > 0)"
