#!/usr/bin/env python3
"""Vendor the subset of the Kubernetes pod schema that a fleet's pod templates may set.

The schema is read from a real kube-apiserver (`/openapi/v3/api/v1`) of the version the project pins
(tools/k8s/versions.env) and written, verbatim, to operator/resource/pod_schema.json: the definitions
reachable from the pod-spec fields in `POD_SPEC_FIELDS` (operator/resource/pod_schema.py), with their
descriptions. `adpfleet crds` turns them into the CRD's structural schema; nothing here interprets
them.

    .venv/bin/python tools/k8s/vendor_pod_schema.py                 # a throwaway local control plane
    .venv/bin/python tools/k8s/vendor_pod_schema.py --kubeconfig K  # a running API server

Then regenerate the CRD (docs/operator.md, "Changing the resource"). tests/operator/test_pod_schema.py
checks the committed file against the session cluster's API server, so a version bump that forgets
this step fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def fetch_openapi(kubeconfig: Path) -> dict:
    from kubernetes import config

    api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        method, url, headers, body, _ = api.param_serialize("GET", "/openapi/v3/api/v1",
                                                            header_params={"Accept": "application/json"},
                                                            auth_settings=["BearerToken"])
        response = api.call_api(method, url, headers, body)
        response.read()
        return json.loads(response.data)
    finally:
        api.close()


def server_version(kubeconfig: Path) -> str:
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        return client.VersionApi(api).get_code().git_version
    finally:
        api.close()


def main(argv: list[str] | None = None) -> int:
    from adpfleet.operator.resource import pod_schema

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", type=Path, help="a running API server (default: start a local one)")
    parser.add_argument("--out", type=Path, default=pod_schema.VENDORED_FILE)
    args = parser.parse_args(argv)

    if args.kubeconfig:
        document, version = fetch_openapi(args.kubeconfig), server_version(args.kubeconfig)
    else:
        from adpfleet.cluster.controlplane import ControlPlane
        with tempfile.TemporaryDirectory(prefix="adpfleet-openapi-") as state:
            plane = ControlPlane(Path(state))
            try:
                report = plane.up()
                document, version = fetch_openapi(report.kubeconfig), server_version(report.kubeconfig)
            finally:
                plane.down()
    vendored = pod_schema.vendor(document, version)
    args.out.write_text(json.dumps(vendored, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}: "
          f"{len(vendored['definitions'])} definitions from Kubernetes {version}, "
          f"{args.out.stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
