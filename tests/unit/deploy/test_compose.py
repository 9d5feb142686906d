"""docker-compose.yml: parses, pins its images, mounts only what exists, and its wiring agrees
with the configs it mounts (every host:port a config names is a service listening there).

No Docker daemon is needed: this reads the files the stack would read.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

import yaml

from tests.helpers import REPO

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DASH = REPO / "dashboards"


def load(rel: str) -> dict:
    return yaml.safe_load((DASH / rel).read_text())


def load_spec_job() -> str:
    return yaml.safe_load((DASH / "slo.yaml").read_text())["job"]


def mounts(service: str) -> dict[str, str]:
    """Container path → host path (relative to the repo) of a service's bind mounts."""
    out = {}
    for vol in SERVICES[service].get("volumes", []):
        host, container = vol.split(":")[:2]
        if host.startswith("."):
            out[container] = host
    return out


def container_ports(service: str) -> set[int]:
    return {int(p.split(":")[-1]) for p in SERVICES[service].get("ports", [])}


def arg(service: str, flag: str) -> str:
    """The value of `--flag=value` or `--flag value` in a service's command."""
    cmd = [str(c) for c in SERVICES[service]["command"]]
    for i, c in enumerate(cmd):
        if c.startswith(flag + "="):
            return c.split("=", 1)[1]
        if c == flag:
            return cmd[i + 1]
    raise AssertionError(f"{service}: no {flag} in {cmd}")


def assert_listens(address: str, service: str, port: int) -> None:
    """`address` (host:port or a URL) names `service` on `port`."""
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    assert (parsed.hostname, parsed.port) == (service, port), f"{address} is not {service}:{port}"
    assert service in SERVICES, f"{address}: no compose service {service}"


def test_images_are_pinned_and_ports_are_loopback_only():
    for name, svc in SERVICES.items():
        image = svc.get("image")
        assert image, f"{name}: no image (built services name theirs too)"
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "/" not in tag, f"{name}: image {image} is not pinned"
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name}: {port} is open beyond this machine"
    assert SERVICES["loadtest"]["profiles"] == ["loadtest"]


def test_every_mounted_file_exists():
    for name in SERVICES:
        for container, host in mounts(name).items():
            assert (REPO / host).exists(), f"{name}: mounts {host}, which is not in the repo"
    for path in ("Dockerfile", ".dockerignore", "loadtest/locustfile.py"):
        assert (REPO / path).is_file(), path


def test_dockerfile_serves_on_all_interfaces_and_copies_what_exists():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r'^CMD \["sightline", "serve", "--host", "0.0.0.0", "--port", "8000"\]', text, re.M)
    for src in re.findall(r"^COPY (\S+)", text, re.M):
        assert (REPO / src).exists(), f"Dockerfile copies {src}, which is not in the repo"
    cmd = SERVICES["sightline"]["command"]
    assert cmd[:4] == ["sightline", "serve", "--host", "0.0.0.0"] and "8000" in cmd
    assert arg("sightline", "--otel-traces-exporter") == "otlp"


def test_prometheus_scrapes_sightline_and_alerts_through_alertmanager():
    assert mounts("prometheus")[arg("prometheus", "--config.file")] == "./dashboards/prometheus/prometheus.yml"
    assert "--enable-feature=exemplar-storage" in SERVICES["prometheus"]["command"]
    prom = load("prometheus/prometheus.yml")
    [job] = [j for j in prom["scrape_configs"] if j["job_name"] == load_spec_job()]
    [target] = job["static_configs"][0]["targets"]
    assert_listens(target, "sightline", int(arg("sightline", "--port")))
    [am] = prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert_listens(am, "alertmanager", 9093)
    assert 9093 in container_ports("alertmanager")
    [rules] = prom["rule_files"]  # relative to the config file, i.e. under /etc/prometheus
    assert mounts("prometheus")["/etc/prometheus/" + Path(rules).parent.as_posix()] == "./dashboards/prometheus/rules"


def test_alertmanager_notifies_the_alert_log_service():
    assert mounts("alertmanager")[arg("alertmanager", "--config.file")] == "./dashboards/alertmanager/alertmanager.yml"
    am = load("alertmanager/alertmanager.yml")
    for receiver in am["receivers"]:
        for hook in receiver["webhook_configs"]:
            assert_listens(hook["url"], "alert-log", int(arg("alert-log", "--port")))
    assert mounts("alert-log")[SERVICES["alert-log"]["command"][1]] == "./dashboards/alertmanager/webhook_log.py"


def test_traces_flow_sightline_to_collector_to_tempo_to_grafana():
    collector = load("otel-collector/config.yaml")
    assert mounts("otel-collector")[arg("otel-collector", "--config")] == "./dashboards/otel-collector/config.yaml"
    http_port = int(collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1])
    assert_listens(arg("sightline", "--otel-exporter-otlp-endpoint"), "otel-collector", http_port)
    tempo = load("tempo/tempo.yaml")
    assert mounts("tempo")[arg("tempo", "-config.file")] == "./dashboards/tempo/tempo.yaml"
    tempo_grpc = int(tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1])
    exporter = collector["exporters"][collector["service"]["pipelines"]["traces"]["exporters"][0]]
    assert_listens(exporter["endpoint"], "tempo", tempo_grpc)
    sources = {d["type"]: d for d in load("grafana/provisioning/datasources/datasources.yaml")["datasources"]}
    assert_listens(sources["tempo"]["url"], "tempo", tempo["server"]["http_listen_port"])
    assert_listens(sources["prometheus"]["url"], "prometheus", 9090)
    assert_listens(sources["alertmanager"]["url"], "alertmanager", 9093)


def test_grafana_is_provisioned_from_the_repo():
    m = mounts("grafana")
    assert m["/etc/grafana/provisioning/datasources"] == "./dashboards/grafana/provisioning/datasources"
    assert m["/etc/grafana/provisioning/dashboards"] == "./dashboards/grafana/provisioning/dashboards"
    [provider] = load("grafana/provisioning/dashboards/dashboards.yaml")["providers"]
    assert m[provider["options"]["path"]] == "./dashboards/grafana/dashboards"
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DASH / "grafana/dashboards" / Path(home).name).is_file()


def test_loadtest_service_runs_the_locustfile_against_sightline():
    svc = SERVICES["loadtest"]
    assert mounts("loadtest")["/app/loadtest/locustfile.py"] == "./loadtest/locustfile.py"
    assert svc["command"][:3] == ["python", "-m", "loadtest"]
    assert_listens(arg("loadtest", "--url"), "sightline", int(arg("sightline", "--port")))
