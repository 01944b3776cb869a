"""Running the real `helm` on charts/adpfleet and reading what it renders.

`helm` is the pinned build from tools/k8s/build.sh (found through adpfleet.cluster.binaries, never
$PATH), so these tests see exactly the Helm the docs name.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "adpfleet"
EXAMPLES = CHART / "examples"

# Every monitoring.coreos.com API the chart can render, as `--api-versions` wants them.
MONITORING_APIS = ("monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PodMonitor",
                   "monitoring.coreos.com/v1/PrometheusRule", "monitoring.coreos.com/v1alpha1/AlertmanagerConfig")
ALL_MONITORING_ON = {"monitoring.serviceMonitor.enabled": "true", "monitoring.prometheusRule.enabled": "true",
                     "monitoring.grafanaDashboard.enabled": "true", "monitoring.alertmanagerConfig.enabled": "true"}


@functools.cache
def helm_path() -> Path:
    from adpfleet.cluster.binaries import ensure_binaries
    path = ensure_binaries().helm
    assert path.exists(), f"{path} is missing: tools/k8s/build.sh builds helm"
    return path


def helm(*args: str, kubeconfig: Path | None = None, check: bool = True, timeout: float = 120,
         input: str | None = None) -> subprocess.CompletedProcess:
    env_args = [f"--kubeconfig={kubeconfig}"] if kubeconfig else []
    proc = subprocess.run([str(helm_path()), *args, *env_args], capture_output=True, text=True, timeout=timeout,
                          input=input)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
    return proc


def set_args(values: dict[str, str] | None) -> list[str]:
    """`--set k=v` for each value (`--set-json` when the value is not a string)."""
    out: list[str] = []
    for key, value in (values or {}).items():
        out += ["--set", f"{key}={value}"] if isinstance(value, str) else ["--set-json", f"{key}={_json(value)}"]
    return out


def _json(value) -> str:
    import json
    return json.dumps(value)


@dataclass(frozen=True)
class Rendered:
    objects: list[dict]

    def kinds(self) -> list[str]:
        return [o["kind"] for o in self.objects]

    def of(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict:
        found = [o for o in self.of(kind) if o["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {[o['metadata']['name'] for o in found]}"
        return found[0]


def template(values: dict | None = None, *, api_versions: tuple[str, ...] = (), release: str = "adp",
             namespace: str = "adpfleet-system", include_crds: bool = False) -> str:
    """What `helm template` prints."""
    args = ["template", release, str(CHART), "--namespace", namespace, *set_args(values)]
    for api in api_versions:
        args += ["--api-versions", api]
    if include_crds:
        args.append("--include-crds")
    return helm(*args).stdout


def render(values: dict | None = None, **kwargs) -> Rendered:
    """What `helm template` prints, as objects (the arguments are template's). Read with libyaml's
    loader: the pure-Python one took ~3 s for a render with the CRDs, most of this module's time."""
    return Rendered([d for d in yaml.load_all(template(values, **kwargs), Loader=yaml.CSafeLoader) if d])


def render_error(values: dict) -> str:
    """What `helm template` says when it refuses the values (fails the test if it does not)."""
    proc = helm("template", "adp", str(CHART), *set_args(values), check=False)
    assert proc.returncode != 0, f"helm accepted {values}"
    return proc.stderr


def operator_container(rendered: Rendered) -> dict:
    return rendered.one("Deployment")["spec"]["template"]["spec"]["containers"][0]
