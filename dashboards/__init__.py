"""Ops assets as code: Grafana dashboards, Prometheus rules and their tests, generated here.

`python -m dashboards.generate` writes grafana/dashboards/*.json and prometheus/{rules,tests}/*.yml
from the Python in this package and the SLO spec in slo.yaml; the hand-written configs
(provisioning, Prometheus, Alertmanager, Collector, Tempo) sit next to them.
"""
