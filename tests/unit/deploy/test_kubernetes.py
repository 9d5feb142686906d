"""deploy/kubernetes: the committed manifests are the generator's output, every object is valid
against the Kubernetes schemas (kubernetes-validate ships them) or, for the Prometheus Operator
and KEDA resources, against the CRD schemas kept in deploy/kubernetes/schemas/; the
PrometheusRule carries exactly the rule files' groups (and promtool accepts them); the objects
refer to each other and to the server as they must.  Offline: no cluster, no network.
"""

from __future__ import annotations

import argparse
import json

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deploy.kubernetes import generate
from serving.args import ServerArgs
from serving.frontend.http.app import ROUTES
from serving.frontend.http.middleware.auth import protected
from telemetry.metrics import BY_NAME
from tests.helpers import REPO
from tests.prom_util import promtool

MANIFESTS = REPO / "deploy/kubernetes/manifests"
SCHEMAS = REPO / "deploy/kubernetes/schemas"
K8S_VERSIONS = ("1.30", "1.37")  # the oldest docs/deploy.md names and the newest the wheel ships
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-inference-v1.json",
}


def objects() -> list[dict]:
    return [
        doc
        for name in generate.outputs()
        if name != "kustomization.yaml"
        for doc in yaml.safe_load_all((MANIFESTS / name).read_text())
        if doc
    ]


OBJECTS = objects()


def one(kind: str, name: str | None = None) -> dict:
    [obj] = [o for o in OBJECTS if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return obj


def crd_validator(api_version: str, kind: str) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(json.loads((SCHEMAS / CRD_SCHEMAS[api_version, kind]).read_text()))


def rule_file_groups() -> list[dict]:
    return [
        g
        for p in sorted((REPO / "dashboards/prometheus/rules").glob("*.yml"))
        for g in yaml.safe_load(p.read_text())["groups"]
    ]


def server() -> dict:
    return one("Deployment", generate.CONFIG.name)["spec"]["template"]["spec"]["containers"][0]


# -- as generated, and valid -------------------------------------------------------------
def test_committed_manifests_are_what_the_generator_writes():
    diff = generate.differences(generate.outputs(), MANIFESTS)
    assert diff == [], f"out of date (run `.venv/bin/python -m deploy.kubernetes.generate`): {diff}"


def test_check_mode_reports_a_hand_edit_and_a_stale_file(tmp_path):
    generate.write(tmp_path, generate.outputs())
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "scaledobject.yaml").write_text((tmp_path / "scaledobject.yaml").read_text().replace("8", "9"))
    (tmp_path / "old.yaml").write_text("{}")
    assert generate.differences(generate.outputs(), tmp_path) == ["old.yaml", "scaledobject.yaml"]
    assert generate.main(["--check", "--out", str(tmp_path)]) == 1


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(
        p.name for p in MANIFESTS.glob("*.yaml") if p.name != "kustomization.yaml"
    )
    assert {o["metadata"].get("namespace") for o in OBJECTS if o["kind"] != "Namespace"} == {generate.CONFIG.namespace}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_objects_are_valid_kubernetes(version):
    builtin = [o for o in OBJECTS if (o["apiVersion"], o["kind"]) not in CRD_SCHEMAS]
    assert {o["kind"] for o in builtin} >= {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "Namespace"}
    for obj in builtin:
        kubernetes_validate.validate(obj, version, strict=True)  # strict: unknown fields fail too
    pod = one("Deployment", generate.CONFIG.name)["spec"]["template"]["spec"]
    typo = {**server(), "livenesProbe": server()["livenessProbe"]}
    bad = {**one("Deployment", generate.CONFIG.name)}
    bad["spec"] = {**bad["spec"], "template": {**bad["spec"]["template"], "spec": {**pod, "containers": [typo]}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


def test_custom_resources_are_valid_against_the_crd_schemas():
    custom = [o for o in OBJECTS if (o["apiVersion"], o["kind"]) in CRD_SCHEMAS]
    assert sorted(o["kind"] for o in custom) == ["InferencePool", "PodMonitor", "PrometheusRule", "ScaledObject"]
    for obj in custom:
        errors = sorted(crd_validator(obj["apiVersion"], obj["kind"]).iter_errors(obj), key=str)
        assert not errors, f"{obj['kind']}: " + "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_crd_schemas_refuse_a_misspelt_field_and_a_wrong_type():
    mon = one("PodMonitor")
    bad = {**mon, "spec": {**mon["spec"], "podMetricEndpoints": mon["spec"]["podMetricsEndpoints"]}}
    assert not crd_validator(mon["apiVersion"], "PodMonitor").is_valid(bad)
    so = one("ScaledObject")
    trigger = {**so["spec"]["triggers"][0], "metadata": {**so["spec"]["triggers"][0]["metadata"], "threshold": 4}}
    assert not crd_validator(so["apiVersion"], "ScaledObject").is_valid(
        {**so, "spec": {**so["spec"], "triggers": [trigger]}}
    )
    rule = one("PrometheusRule")
    assert not crd_validator(rule["apiVersion"], "PrometheusRule").is_valid(
        {**rule, "apiVersion": "monitoring.coreos.com/v2"}
    )


# -- the rules and the dashboards are the repo's ---------------------------------------
def test_prometheus_rule_groups_are_the_rule_files_groups():
    assert one("PrometheusRule")["spec"]["groups"] == rule_file_groups()


def test_promtool_accepts_the_prometheus_rule_groups(tmp_path):
    path = tmp_path / "prometheusrule-groups.yml"
    path.write_text(yaml.safe_dump({"groups": one("PrometheusRule")["spec"]["groups"]}, sort_keys=False))
    r = promtool("check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


def test_one_dashboard_config_map_per_board_for_the_grafana_sidecar():
    boards = {p.name: p.read_text() for p in sorted((REPO / "dashboards/grafana/dashboards").glob("*.json"))}
    maps = [o for o in OBJECTS if o["kind"] == "ConfigMap" and o["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert {k: v for m in maps for k, v in m["data"].items()} == boards
    for m in maps:
        assert len(m["data"]) == 1
        # 1 MiB is the ConfigMap limit; 256 KiB what client-side `kubectl apply` keeps in an annotation
        assert len(json.dumps(m)) < 256 * 1024, m["metadata"]["name"]


# -- the objects fit together -----------------------------------------------------------
def test_server_flags_parse_and_probes_use_real_unprotected_routes():
    c = server()
    assert c["args"][:2] == ["sightline", "serve"]
    parser = argparse.ArgumentParser(allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli(parser.parse_args(c["args"][2:]))
    assert args.host == "0.0.0.0" and args.port == c["ports"][0]["containerPort"] and c["ports"][0]["name"] == "http"
    paths = {r.path for r in ROUTES}
    keyed = ServerArgs(api_key="k", auth_metrics=True)
    for probe, path in (("startupProbe", "/health"), ("readinessProbe", "/health"), ("livenessProbe", "/livez")):
        get = c[probe]["httpGet"]
        assert (get["path"], get["port"]) == (path, "http") and path in paths and not protected(path, keyed), probe
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] > args.startup_timeout
    assert args.threads == int(c["resources"]["requests"]["cpu"])  # not the node's core count
    # a pod whose engine will not come back is restarted: /livez fails once the grace is over
    assert 0 <= args.liveness_down_grace == generate.CONFIG.liveness_down_grace


def test_termination_grace_covers_the_prestop_sleep_and_the_drain():
    pod = one("Deployment", generate.CONFIG.name)["spec"]["template"]["spec"]
    c = server()
    grace = float(c["args"][c["args"].index("--shutdown-grace") + 1])
    [_, sleep] = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pod["terminationGracePeriodSeconds"] >= int(sleep) + grace + 20
    env = {e["name"]: e for e in c["env"]}
    assert env["SIGHTLINE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == generate.CONFIG.api_key_secret


def test_service_monitor_budget_and_autoscaler_select_the_server_pods():
    deploy = one("Deployment", generate.CONFIG.name)
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    job = yaml.safe_load((REPO / "dashboards/slo.yaml").read_text())["job"]

    def selects(sel: dict) -> bool:
        return sel.items() <= pod_labels.items()

    svc, pdb, mon, so = (
        one("Service", generate.CONFIG.name),
        one("PodDisruptionBudget"),
        one("PodMonitor"),
        one("ScaledObject"),
    )
    assert selects(svc["spec"]["selector"]) and selects(pdb["spec"]["selector"]["matchLabels"])
    assert selects(deploy["spec"]["selector"]["matchLabels"]) and selects(mon["spec"]["selector"]["matchLabels"])
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    [ep] = mon["spec"]["podMetricsEndpoints"]
    assert (ep["port"], ep["path"]) == ("http", "/metrics") and mon["spec"]["scrapeProtocols"][0].startswith(
        "OpenMetrics"
    )
    relabel = {r["targetLabel"]: r for r in ep["relabelings"]}
    assert relabel["job"]["replacement"] == job
    assert relabel["instance"]["sourceLabels"] == ["__meta_kubernetes_pod_name"]
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": generate.CONFIG.name}
    assert "replicas" not in deploy["spec"]  # the autoscaler owns it
    [trigger] = so["spec"]["triggers"]
    assert generate.QUEUE_METRIC in BY_NAME and f'{generate.QUEUE_METRIC}{{job="{job}"' in trigger["metadata"]["query"]


def test_traces_flow_server_to_collector_to_tempo_with_the_slo_threshold():
    env = {e["name"]: e.get("value") for e in server()["env"]}
    svc = one("Service", generate.CONFIG.collector_name)
    http_port = {p["name"]: p["port"] for p in svc["spec"]["ports"]}["otlp-http"]
    assert (
        env["OTEL_EXPORTER_OTLP_ENDPOINT"]
        == f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:{http_port}"
    )
    config = yaml.safe_load(one("ConfigMap", generate.CONFIG.collector_name)["data"]["config.yaml"])
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(f":{http_port}")
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["processors"] == ["memory_limiter", "tail_sampling", "batch"]
    policies = {p["name"]: p for p in config["processors"]["tail_sampling"]["policies"]}
    assert policies["errors"]["status_code"]["status_codes"] == ["ERROR"]
    ttft = yaml.safe_load((REPO / "dashboards/slo.yaml").read_text())["slos"]["ttft"]["sli"]["latency"]["threshold"]
    assert policies["slow-first-token"]["ottl_condition"]["span"] == [
        f'attributes["sightline.ttft_seconds"] > {float(ttft)}'
    ]
    collector = one("Deployment", generate.CONFIG.collector_name)
    assert collector["spec"]["replicas"] == 1  # tail sampling: every span of a trace in one collector
    assert config["exporters"][pipeline["exporters"][0]]["endpoint"] == generate.CONFIG.tempo_endpoint
