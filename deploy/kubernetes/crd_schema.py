"""A CustomResourceDefinition's `openAPIV3Schema` → a JSON Schema file the tests validate with.

    python -m deploy.kubernetes.crd_schema CRD.yaml... --out deploy/kubernetes/schemas

Writes `<kind>-<group>-<version>.json` (lower case) for the storage version of each CRD.
`apiVersion` and `kind` become one-value enums (draft 4 has no `const`), and objects are
closed like the API server's strict field validation: an object schema with `properties`
and no `additionalProperties` refuses other keys, unless it says
`x-kubernetes-preserve-unknown-fields`. A misspelt field then fails the test instead of
being dropped by the API server.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml


def _close(node):
    if isinstance(node, dict):
        out = {k: _close(v) for k, v in node.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_close(v) for v in node]
    return node


def json_schema(crd: dict) -> tuple[str, dict]:
    """(file name, schema) of the CRD's storage version."""
    spec = crd["spec"]
    [version] = [v for v in spec["versions"] if v.get("storage")]
    schema = _close(version["schema"]["openAPIV3Schema"])
    api_version = f"{spec['group']}/{version['name']}"
    schema["properties"]["apiVersion"] = {"type": "string", "enum": [api_version]}
    schema["properties"]["kind"] = {"type": "string", "enum": [spec["names"]["kind"]]}
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    schema = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "description": f"{spec['names']['kind']} {api_version}: openAPIV3Schema of CRD {crd['metadata']['name']}",
        **{k: v for k, v in schema.items() if k != "description"},
    }
    name = f"{spec['names']['kind']}-{spec['group'].split('.')[0]}-{version['name']}.json".lower()
    return name, schema


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.kubernetes.crd_schema", description=__doc__.splitlines()[0])
    ap.add_argument("crds", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "schemas")
    args = ap.parse_args(argv)
    for path in args.crds:
        for crd in yaml.safe_load_all(path.read_text()):
            if crd and crd.get("kind") == "CustomResourceDefinition":
                name, schema = json_schema(crd)
                (args.out / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
                print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
