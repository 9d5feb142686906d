"""The llm-d precise-prefix-cache example overlay, checked offline: the committed files are the generator's,
its JSON patches apply to the base manifests, the patched server's flags parse and agree with the scorer's
config (endpoint, topic, block size, hash seed, one shared namespace), and the picker config is valid."""

from __future__ import annotations

import argparse
import copy
import json

import jsonschema
import yaml

from deploy.kubernetes import generate as base
from deploy.kubernetes import inference_pool as gie
from deploy.kubernetes import precise_prefix as ex
from serving.args import ServerArgs
from serving.engine.kv_event_publisher import binds
from tests.helpers import REPO


def apply(doc: dict, patch: list[dict]) -> dict:
    """RFC 6902 `add` (to a list's end) and `replace`, the two operations the overlay uses."""
    doc = copy.deepcopy(doc)
    for op in patch:
        *parents, last = op["path"].strip("/").split("/")
        target = doc
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if op["op"] == "add" and last == "-":
            target.append(op["value"])
        elif op["op"] == "replace" and last in target:
            target[last] = op["value"]
        else:
            raise AssertionError(f"patch does not apply: {op}")
    return doc


def overlay() -> dict[str, list[dict]]:
    return {
        name: yaml.safe_load((ex.OUT / name).read_text()) for name in ("server-kv-events.yaml", "picker-config.yaml")
    }


def base_doc(file: str, kind: str) -> dict:
    return next(d for d in yaml.safe_load_all((base.ROOT / base.MANIFESTS / file).read_text()) if d["kind"] == kind)


def test_committed_files_are_what_the_generator_writes():
    assert base.differences(ex.outputs(), ex.OUT) == []
    kust = yaml.safe_load((ex.OUT / "kustomization.yaml").read_text())
    assert (ex.OUT / kust["resources"][0] / "kustomization.yaml").is_file()
    assert sorted(p["path"] for p in kust["patches"]) == sorted(overlay())


def test_patched_server_publishes_where_the_scorer_listens_with_its_hashing():
    deploy = apply(base_doc("sightline.yaml", "Deployment"), overlay()["server-kv-events.yaml"])
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    parser = argparse.ArgumentParser(allow_abbrev=False)
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli(parser.parse_args(container["args"][2:]))
    params = ex.scorer()["parameters"]
    host, port = args.kv_events_endpoint.removeprefix("tcp://").rsplit(":", 1)
    assert not binds(args.kv_events_endpoint)  # the server connects; the picker binds tcp://*:PORT
    assert host == f"{base.CONFIG.epp_service}.{base.CONFIG.namespace}.svc"
    assert params["kvEventsConfig"]["zmqEndpoint"] == f"tcp://*:{port}"
    topic = args.kv_events_topic
    assert topic.startswith(params["kvEventsConfig"]["topicFilter"]) and "$(POD_IP)" in topic
    assert args.kv_events_block_size == params["tokenProcessorConfig"]["blockSize"]
    assert args.kv_events_hash_seed == params["tokenProcessorConfig"]["hashSeed"]
    assert args.prefix_cache_sharing == "salt-only" and args.kv_events_token_ids
    assert 0 < args.kv_events_connect_timeout < args.startup_timeout


def test_picker_config_is_valid_and_scores_with_the_precise_scorer():
    cm = apply(base_doc("inferencepool.yaml", "ConfigMap"), overlay()["picker-config.yaml"])
    config = yaml.safe_load(cm["data"][gie.CONFIG_KEY])
    schema = json.loads((REPO / "deploy/kubernetes/schemas/endpointpickerconfig-inference-v1alpha1.json").read_text())
    jsonschema.Draft4Validator(schema).validate(config)
    types = {p["type"] for p in config["plugins"]}
    assert "precise-prefix-cache-scorer" in types and "prefix-cache-scorer" not in types
    refs = {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]}
    assert refs <= types and "precise-prefix-cache-scorer" in refs
