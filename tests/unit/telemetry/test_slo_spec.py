"""The SLO spec is found as package data of `dashboards`, so an installed server reads the
same file as a checkout (and as `python -m dashboards.generate`)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import dashboards
from dashboards.slo import SPEC_PATH
from telemetry.slo_spec import SLO_SPEC, slo_spec_goodput, spec_found
from tests.helpers import REPO


def test_the_spec_is_the_dashboards_package_file():
    assert SLO_SPEC is not None and spec_found()
    assert Path(str(SLO_SPEC)) == Path(dashboards.__file__).with_name("slo.yaml") == SPEC_PATH
    assert slo_spec_goodput()[0], "no latency thresholds read"


def test_the_spec_is_package_data():
    """Without this a wheel would not carry it, and an installed server would fall back to defaults."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "slo.yaml" in config["package-data"]["dashboards"]
    assert any(p.startswith("dashboards") for p in config["packages"]["find"]["include"])


def test_an_absent_spec_gives_no_thresholds(tmp_path):
    assert not spec_found(None) and slo_spec_goodput(None) == ({}, None)
    assert slo_spec_goodput(str(tmp_path / "absent.yaml")) == ({}, None)
