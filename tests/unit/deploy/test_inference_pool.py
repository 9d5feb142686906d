"""The InferencePool and the Endpoint Picker's config: the pool selects the server pods on their
port, and the picker reads metrics the server exports, one series per pod, validated offline
against the vendored schemas (deploy/kubernetes/schemas)."""

from __future__ import annotations

import json

import jsonschema
import yaml

from deploy.kubernetes import generate
from deploy.kubernetes import inference_pool as gie
from telemetry.metrics import BY_NAME
from tests.helpers import REPO

SCHEMAS = REPO / "deploy/kubernetes/schemas"
DOCS = [d for d in yaml.safe_load_all((REPO / "deploy/kubernetes/manifests/inferencepool.yaml").read_text()) if d]


def _schema(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text())


def picker_config() -> dict:
    [cm] = [d for d in DOCS if d["kind"] == "ConfigMap"]
    return yaml.safe_load(cm["data"][gie.CONFIG_KEY])


def extractor_params(config: dict) -> dict:
    [plugin] = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    return plugin["parameters"]


def test_pool_selects_the_server_pods_on_their_port_through_the_picker_service():
    [pool] = [d for d in DOCS if d["kind"] == "InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    deploy = [
        d
        for d in yaml.safe_load_all((REPO / "deploy/kubernetes/manifests/sightline.yaml").read_text())
        if d and d["kind"] == "Deployment"
    ][0]
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    port = deploy["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert pool["spec"]["targetPorts"] == [{"number": port}]
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"]["number"]) == (generate.CONFIG.epp_service, generate.CONFIG.epp_port)


def test_picker_config_is_valid_and_reads_one_gauge_per_pod():
    config = picker_config()
    jsonschema.Draft4Validator(_schema("endpointpickerconfig-inference-v1alpha1.json")).validate(config)
    params = extractor_params(config)
    jsonschema.Draft4Validator(
        _schema("endpointpickerconfig-inference-v1alpha1.json")["definitions"]["coreMetricsExtractorParameters"]
    ).validate(params)
    [engine] = params["engineConfigs"]
    assert params["defaultEngine"] == engine["name"]  # every pod of the pool, with no engine label needed
    for field in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
        spec = BY_NAME[engine[field]]  # a metric the server defines
        assert spec.kind == "gauge" and "dp_rank" not in spec.labels, spec.name  # one series per pod
    refs = {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]}
    assert refs <= {p.get("name", p["type"]) for p in config["plugins"]}


def test_picker_schema_refuses_a_misspelt_field():
    config = picker_config()
    params = extractor_params(config)
    bad = {**params, "engineConfigs": [{**params["engineConfigs"][0], "kvUsageSpecs": "x"}]}
    schema = _schema("endpointpickerconfig-inference-v1alpha1.json")
    assert not jsonschema.Draft4Validator(schema["definitions"]["coreMetricsExtractorParameters"]).is_valid(bad)
    assert not jsonschema.Draft4Validator(schema).is_valid({**config, "schedulingProfile": []})
    pool_schema = jsonschema.Draft4Validator(_schema("inferencepool-inference-v1.json"))
    [pool] = [d for d in DOCS if d["kind"] == "InferencePool"]
    assert not pool_schema.is_valid({**pool, "spec": {**pool["spec"], "targetPort": 8000}})
