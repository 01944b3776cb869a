"""A pod's volumes, materialised as directories under `<pod dir>/volumes/<name>` (or found on the
host: hostPath, and the hostPath or local PersistentVolume a claim is bound to).

The launcher (`podinit.py`) later bind-mounts them at each container's mountPaths. Supported:
emptyDir, configMap, secret, downwardAPI, projected (serviceAccountToken, configMap, secret,
downwardAPI), hostPath and persistentVolumeClaim (bound to a PersistentVolume with a `hostPath` or
`local` source; `readOnly: true` on the volume makes every mount of it read-only). ConfigMap and
Secret contents are written when the pod starts and not refreshed; service-account tokens are
refreshed at 80 % of their lifetime, like the kubelet does. Any other type (csi, ephemeral, nfs,
image, ...) gets an empty directory in its place and a `NotSupportedLocally` event: the pod runs.
"""

from __future__ import annotations

import base64
import datetime as dt
import os
from dataclasses import dataclass, field
from pathlib import Path

from adpfleet.cluster.agent import podenv
from adpfleet.cluster.agent.kubeapi import ApiError, KubeApi

SUPPORTED = ("emptyDir", "configMap", "secret", "downwardAPI", "projected", "hostPath", "persistentVolumeClaim")
API_FED = ("configMap", "secret", "downwardAPI", "projected")  # always mounted read-only, like the kubelet


class VolumeError(Exception):
    """A volume cannot be set up yet or at all (kubelet: FailedMount)."""


@dataclass
class TokenFile:
    path: Path
    service_account: str
    audience: str | None
    expiration_seconds: int
    refresh_at: float = 0.0  # time.time() at which to request a new one


@dataclass
class PodVolumes:
    paths: dict[str, Path] = field(default_factory=dict)
    tokens: list[TokenFile] = field(default_factory=list)
    read_only_volumes: set[str] = field(default_factory=set)
    substituted: list[str] = field(default_factory=list)  # what stands in for an unsupported volume

    def read_only(self, name: str) -> bool:
        """Every mount of the volume is read-only, whatever the mount says."""
        return name in self.read_only_volumes


async def materialise(pod: dict, pod_dir: Path, api: KubeApi, fetch: podenv.Fetch, pod_ip: str,
                      node: podenv.NodeContext) -> PodVolumes:
    result = PodVolumes()
    for volume in pod["spec"].get("volumes") or []:
        name = volume["name"]
        kind = next((k for k in volume if k != "name"), "unknown")
        if kind in API_FED:
            result.read_only_volumes.add(name)
        if kind == "hostPath":
            result.paths[name] = _host_path(name, volume["hostPath"])
            continue
        if kind == "persistentVolumeClaim":
            result.paths[name] = await _claimed_path(api, pod["metadata"]["namespace"], name, volume[kind])
            if volume[kind].get("readOnly"):
                result.read_only_volumes.add(name)
            continue
        target = pod_dir / "volumes" / name
        target.mkdir(parents=True, exist_ok=True)
        result.paths[name] = target
        if kind not in SUPPORTED:
            result.substituted.append(f"volume {name!r}: {kind} volumes are not supported by the local node "
                                      f"agent; an empty directory stands in for it (supported: {', '.join(SUPPORTED)})")
            continue
        spec = volume[kind]
        if kind == "emptyDir":
            continue
        sources = spec.get("sources") or [] if kind == "projected" else [{kind: spec}]
        default_mode = spec.get("defaultMode", 0o644)
        for source in sources:
            files, token = await _source_files(pod, source, target, fetch, pod_ip, node)
            _write(target, files, default_mode)
            if token:
                await refresh_token(api, pod, token)
                result.tokens.append(token)
    return result


def _host_path(volume: str, source: dict) -> Path:
    """A hostPath source (of a volume or a PersistentVolume), with the kubelet's type checks."""
    host, kind = Path(source["path"]), source.get("type") or ""
    if kind == "DirectoryOrCreate":
        host.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate" and not host.exists():
        host.parent.mkdir(parents=True, exist_ok=True)
        host.touch()
    if not host.exists():
        raise VolumeError(f"volume {volume}: hostPath {host} does not exist")
    if kind in ("Directory", "DirectoryOrCreate") and not host.is_dir():
        raise VolumeError(f"volume {volume}: hostPath {host} is not a directory")
    if kind in ("File", "FileOrCreate") and not host.is_file():
        raise VolumeError(f"volume {volume}: hostPath {host} is not a file")
    return host


async def _claimed_path(api: KubeApi, namespace: str, volume: str, source: dict) -> Path:
    """The host directory of the PersistentVolume the claim is bound to."""
    claim_name = source["claimName"]
    try:
        claim = await api.get(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim_name}")
    except ApiError as exc:
        if exc.status == 404:
            raise VolumeError(f'volume {volume}: persistentvolumeclaim "{claim_name}" not found') from None
        raise
    phase = (claim.get("status") or {}).get("phase", "Pending")
    if phase != "Bound":
        raise VolumeError(f'volume {volume}: persistentvolumeclaim "{claim_name}" is not bound (phase {phase})')
    pv_name = claim["spec"]["volumeName"]
    pv = await api.get(f"/api/v1/persistentvolumes/{pv_name}")
    spec = pv["spec"]
    if "hostPath" in spec:
        return _host_path(volume, spec["hostPath"])
    if "local" in spec:
        path = Path(spec["local"]["path"])
        if not path.exists():
            raise VolumeError(f"volume {volume}: local volume {pv_name}: path {path} does not exist")
        return path
    source_kind = next((k for k in spec if k not in _PV_SPEC_FIELDS), "unknown")
    raise VolumeError(f'volume {volume}: persistentvolume "{pv_name}" has a {source_kind} source; the local '
                      "node agent mounts only hostPath and local volumes")


_PV_SPEC_FIELDS = {"accessModes", "capacity", "claimRef", "mountOptions", "nodeAffinity",
                   "persistentVolumeReclaimPolicy", "storageClassName", "volumeMode", "volumeAttributesClassName"}


async def refresh_token(api: KubeApi, pod: dict, token: TokenFile) -> None:
    """Request a token bound to this pod for its service account and write it atomically."""
    meta = pod["metadata"]
    spec: dict = {"expirationSeconds": token.expiration_seconds,
                  "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]}}
    if token.audience:
        spec["audiences"] = [token.audience]
    try:
        answer = await api.request(
            "POST", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{token.service_account}/token",
            body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
    except ApiError as exc:
        raise VolumeError(f"requesting a token for service account {token.service_account}: {exc}") from None
    expires = dt.datetime.fromisoformat(answer["status"]["expirationTimestamp"].replace("Z", "+00:00"))
    now = dt.datetime.now(dt.timezone.utc)
    token.refresh_at = (now + 0.8 * (expires - now)).timestamp()
    _write(token.path.parent, {token.path.name: (answer["status"]["token"].encode(), None)}, 0o644)


async def _source_files(pod: dict, source: dict, target: Path, fetch: podenv.Fetch, pod_ip: str,
                        node: podenv.NodeContext) -> tuple[dict[str, tuple[bytes, int | None]], TokenFile | None]:
    if "serviceAccountToken" in source:
        sat = source["serviceAccountToken"]
        return {}, TokenFile(target / sat["path"], pod["spec"].get("serviceAccountName") or "default",
                             sat.get("audience"), int(sat.get("expirationSeconds", 3607)))
    if "downwardAPI" in source:
        files = {}
        for item in source["downwardAPI"].get("items") or []:
            if "fieldRef" in item:
                value = podenv.field_ref(pod, item["fieldRef"]["fieldPath"], pod_ip, node.host_ip)
            else:
                value = podenv.resource_field_ref(pod, item["resourceFieldRef"], "", node)
            files[item["path"]] = (value.encode(), item.get("mode"))
        return files, None
    kind = "ConfigMap" if "configMap" in source else "Secret"
    ref = source["configMap" if kind == "ConfigMap" else "secret"]
    name = ref.get("name") or ref.get("secretName")
    obj = await fetch(kind, name)
    if obj is None:
        if ref.get("optional"):
            return {}, None
        raise VolumeError(f'{kind.lower()} "{name}" not found')
    data = {k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()}
    if kind == "Secret":
        data.update({k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()})
    else:
        data.update({k: v.encode() for k, v in (obj.get("data") or {}).items()})
    items = ref.get("items")
    if not items:
        return {k: (v, None) for k, v in data.items()}, None
    files = {}
    for item in items:
        if item["key"] not in data:
            if ref.get("optional"):
                continue
            raise VolumeError(f'{kind.lower()} "{name}" has no key {item["key"]!r}')
        files[item["path"]] = (data[item["key"]], item.get("mode"))
    return files, None


def _write(directory: Path, files: dict[str, tuple[bytes, int | None]], default_mode: int) -> None:
    for rel, (content, mode) in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(content)
        os.chmod(tmp, mode if mode is not None else default_mode)
        tmp.replace(path)  # atomic: a reader sees the old or the new token, never half of one


def ensure_host_path(path: Path, *, is_file: bool, ledger: Path) -> None:
    """Create a missing mount point (or working directory) on the host and list what was created in
    `ledger`, so that `cluster down` can remove it again."""
    if path.exists() or path.is_symlink():
        return
    missing = [p for p in [*reversed(path.parents), path] if not p.exists()]
    for p in missing[:-1]:
        p.mkdir(exist_ok=True)
    if is_file:
        missing[-1].touch()
    else:
        missing[-1].mkdir(exist_ok=True)
    with open(ledger, "a") as out:
        out.writelines(f"{p}\n" for p in missing)
