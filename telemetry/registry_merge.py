"""One `/metrics` over several tokenizer workers: their registries merged at scrape time.

Each worker keeps its own `prometheus_client` registry, observed on its request path as
with one worker (no message per token, exemplars attached where they are observed).  At
a scrape the hub asks every worker for a `snapshot` (plain data, exemplars included),
then `merge` builds one exposition:

* a family the hub itself exports (the engine's numbers, failures and restarts,
  build info, process metrics) comes from the hub alone: workers' copies are ignored;
* a counter or histogram is summed over the workers, by label set, keeping the newest
  exemplar of each series and the earliest `_created`;
* a gauge keeps one series per worker, with a `worker` label (in-flight requests, open
  connections: a sum over workers is the server's).

A worker that died leaves its counters and histograms behind (`Retired`), so no
counter goes backwards when it is replaced; its gauges go with it.

Why not prometheus_client's multiprocess mode (as SGLang and vLLM use): it keeps no
exemplars, needs a shared directory of mmapped files and a cleanup hook per dead pid.
Why not one registry fed over ZMQ with every observation: a message per token per
request, and the request path would depend on the hub.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.samples import Exemplar as PromExemplar

from protocol.io_struct import Exemplar, MetricFamily, MetricSample

SUMMED = ("counter", "histogram", "summary", "gaugehistogram")
Key = tuple[str, tuple[tuple[str, str], ...]]


def snapshot(registry: CollectorRegistry) -> list[MetricFamily]:
    """Every family of `registry`, as data that crosses a socket."""
    out = []
    for fam in registry.collect():
        samples = [
            MetricSample(
                s.name,
                dict(s.labels),
                float(s.value),
                Exemplar(dict(s.exemplar.labels), float(s.exemplar.value), s.exemplar.timestamp)
                if s.exemplar
                else None,
            )
            for s in fam.samples
        ]
        out.append(MetricFamily(fam.name, fam.type, fam.documentation, samples))
    return out


def _key(s: MetricSample) -> Key:
    return s.name, tuple(sorted(s.labels.items()))


def _newer(a: Exemplar | None, b: Exemplar | None) -> Exemplar | None:
    if a is None or b is None:
        return a or b
    return b if (b.timestamp or 0) >= (a.timestamp or 0) else a


def _add(into: dict[Key, MetricSample], s: MetricSample) -> None:
    k = _key(s)
    old = into.get(k)
    if old is None:
        into[k] = MetricSample(s.name, dict(s.labels), s.value, s.exemplar)
    elif s.name.endswith("_created"):
        old.value = min(old.value, s.value)
    else:
        old.value += s.value
        old.exemplar = _newer(old.exemplar, s.exemplar)


class Retired:
    """The counters and histograms of workers that died, summed: they stay in every scrape."""

    def __init__(self) -> None:
        self.families: dict[str, MetricFamily] = {}
        self.samples: dict[str, dict[Key, MetricSample]] = {}

    def add(self, families: list[MetricFamily]) -> None:
        for fam in families:
            if fam.type not in SUMMED:
                continue
            self.families.setdefault(fam.name, MetricFamily(fam.name, fam.type, fam.help, []))
            into = self.samples.setdefault(fam.name, {})
            for s in fam.samples:
                _add(into, s)

    def as_families(self) -> list[MetricFamily]:
        return [
            MetricFamily(f.name, f.type, f.help, list(self.samples[f.name].values())) for f in self.families.values()
        ]


def merge(hub: list[MetricFamily], workers: dict[int, list[MetricFamily]], retired: Retired) -> list[MetricFamily]:
    """The one exposition: the hub's families, then every other family merged over the workers."""
    own = {f.name for f in hub}
    merged: dict[str, MetricFamily] = {}
    summed: dict[str, dict[Key, MetricSample]] = {}
    sources = [(None, retired.as_families())] + sorted(workers.items())
    for worker, families in sources:
        for fam in families:
            if fam.name in own:
                continue
            out = merged.setdefault(fam.name, MetricFamily(fam.name, fam.type, fam.help, []))
            if fam.type in SUMMED:
                into = summed.setdefault(fam.name, {})
                for s in fam.samples:
                    _add(into, s)
            elif worker is not None:
                out.samples += [
                    MetricSample(s.name, {**s.labels, "worker": str(worker)}, s.value, s.exemplar) for s in fam.samples
                ]
    for name, samples in summed.items():
        merged[name].samples = list(samples.values())
    return list(hub) + list(merged.values())


class FamiliesCollector:
    """A registry collector that yields given `MetricFamily`s (to render them with prometheus_client)."""

    def __init__(self, families: list[MetricFamily]) -> None:
        self.families = families

    def collect(self):
        for fam in self.families:
            m = Metric(fam.name, fam.help, fam.type)
            for s in fam.samples:
                ex = PromExemplar(s.exemplar.labels, s.exemplar.value, s.exemplar.timestamp) if s.exemplar else None
                m.add_sample(s.name, s.labels, s.value, exemplar=ex)
            yield m


def registry_of(families: list[MetricFamily]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FamiliesCollector(families))
    return reg
