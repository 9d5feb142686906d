"""The Gateway API Inference Extension objects for the server pods: an `InferencePool`
(`inference.networking.k8s.io/v1`) and the Endpoint Picker's configuration.

The picker (EPP) routes each request to the pod with the best score from what it scrapes
off `/metrics`: the model-server protocol's queued requests, running requests and KV
cache utilisation.  A sightline pod exports each as one series over all its engine ranks
(`sightline_server_num_requests_waiting`, `..._running`, `sightline_server_kv_cache_usage_perc`,
telemetry/metrics.py), and the `core-metrics-extractor` plugin is told those names for
engine `sightline`, the default for every pod of the pool.  The EPP itself (its
Deployment, Service and RBAC) comes from the upstream `inferencepool` Helm chart of the
pinned release, given this file's config: docs/deploy.md shows the command.
"""

from __future__ import annotations

EPP_VERSION = "v1.5.0"  # gateway-api-inference-extension: the vendored CRD and config schemas are of this tag
POOL_API = "inference.networking.k8s.io/v1"
EPP_CONFIG_API = "inference.networking.x-k8s.io/v1alpha1"
ENGINE = "sightline"
METRICS = {  # the core-metrics-extractor's engine config field -> our metric (one series per pod)
    "queuedRequestsSpec": "sightline_server_num_requests_waiting",
    "runningRequestsSpec": "sightline_server_num_requests_running",
    "kvUsageSpec": "sightline_server_kv_cache_usage_perc",
}
CONFIG_KEY = "sightline-plugins.yaml"  # the file name in the ConfigMap (the chart's pluginsConfigFile)


def endpoint_picker_config(metrics_path: str = "/metrics") -> dict:
    """Scores: queue length, KV cache utilisation, prefix-cache affinity (the chart's default set),
    from our metric names."""
    scorers = ["queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"]
    return {
        "apiVersion": EPP_CONFIG_API,
        "kind": "EndpointPickerConfig",
        "plugins": [
            *({"type": s} for s in scorers),
            {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": metrics_path}},
            {
                "type": "core-metrics-extractor",
                "parameters": {"defaultEngine": ENGINE, "engineConfigs": [{"name": ENGINE, **METRICS}]},
            },
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": s, "weight": 1} for s in scorers]}],
    }


def inference_pool(meta: dict, selector: dict, port: int, epp_service: str, epp_port: int) -> dict:
    """The pool of server pods (`selector`, serving on `port`) and the EPP Service that picks among them."""
    return {
        "apiVersion": POOL_API,
        "kind": "InferencePool",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": [{"number": port}],
            "appProtocol": "http",
            # no picker, no routing: a request waits for the EPP rather than going to an arbitrary pod
            "endpointPickerRef": {
                "kind": "Service",
                "name": epp_service,
                "port": {"number": epp_port},
                "failureMode": "FailClose",
            },
        },
    }


def picker_config_map(meta: dict, config_text: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {CONFIG_KEY: config_text}}
