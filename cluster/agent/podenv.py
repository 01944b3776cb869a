"""A container's environment and command line, as the kubelet builds them.

Order: the agent's base variables (PATH with this Python's bin first, HOME, HOSTNAME, the
`kubernetes` Service variables pointing at the loopback apiserver, the container's own TMPDIR, and
what the adpfleet images set — `image_env()`, since the local node runs this Python instead of an
image), then `envFrom`, then `env` in order, each value `$(VAR)`-expanded against what came before;
finally `command` and `args` are expanded against the result.

vLLM's images run `vllm` (their entrypoint is `vllm serve`): the local node runs it from the vLLM
environment (`adpfleet.cluster.vllm_env`), whose `bin/` (holding only `vllm`) follows this Python's
on the PATH when it is built.
"""

from __future__ import annotations

import base64
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Awaitable, Callable

from adpfleet.cluster.agent import hosts
from adpfleet.contract import quantity

Fetch = Callable[[str, str], Awaitable[dict | None]]  # (kind, name) -> object or None
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


class ContainerConfigError(Exception):
    """The pod is valid but refers to something missing (kubelet: CreateContainerConfigError)."""


@dataclass(frozen=True)
class NodeContext:
    host_ip: str
    apiserver_host: str
    apiserver_port: int
    allocatable: dict[str, str]
    pass_env: tuple[str, ...] = ()
    vllm_bin: str = ""       # the vLLM environment's bin/ (only `vllm`), "" when it is not built ...
    vllm_missing: str = ""   # ... and then why, with how to build it


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: `$$` escapes a dollar, an unknown `$(VAR)` stays as written."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            out.append(env.get(name, text[i:end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def image_env() -> dict[str, str]:
    """The variables docker/runtime.Dockerfile bakes in, pointing at this machine: the C++ kernels
    `./scripts/setup` built (a pod's HOME is its own scratch volume, so without this every server
    would compile them again) and one intra-op thread per rank."""
    kernels = os.environ.get("ADPFLEET_KERNEL_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "adpfleet",
                                                                     "kernels")
    return {"ADPFLEET_KERNEL_DIR": kernels, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1"}


def base_env(pod: dict, node: NodeContext, tmpdir: str = "") -> dict[str, str]:
    bin_dirs = [os.path.join(sys.prefix, "bin")] + ([node.vllm_bin] if node.vllm_bin else [])  # `adpfleet`, `vllm`
    env = {
        "PATH": ":".join(bin_dirs + ["/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]),
        "HOME": os.environ.get("HOME", "/root"),
        "HOSTNAME": hosts.pod_hostname(pod),
        # No kube-proxy: in-cluster clients reach the apiserver on loopback directly.
        "KUBERNETES_SERVICE_HOST": node.apiserver_host,
        "KUBERNETES_SERVICE_PORT": str(node.apiserver_port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(node.apiserver_port),
        "KUBERNETES_PORT": f"tcp://{node.apiserver_host}:{node.apiserver_port}",
        **image_env(),
    }
    if tmpdir:  # a container's /tmp is its own; here every pod would share the host's (vLLM leaves sockets there)
        env["TMPDIR"] = tmpdir
    env.update({k: os.environ[k] for k in node.pass_env if k in os.environ})
    return env


def field_ref(pod: dict, path: str, pod_ip: str, host_ip: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    if match := _SUBSCRIPT.match(path):
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    simple = {
        "metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
        "metadata.uid": meta.get("uid", ""), "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip, "status.podIPs": pod_ip, "status.hostIP": host_ip, "status.hostIPs": host_ip,
    }
    if path in ("metadata.labels", "metadata.annotations"):  # only meaningful in downwardAPI volumes
        items = sorted((meta.get(path.split(".")[1]) or {}).items())
        return "\n".join(f'{k}="{v}"' for k, v in items)
    if path not in simple:
        raise ContainerConfigError(f"unsupported fieldRef {path!r}")
    return simple[path]


def resource_field_ref(pod: dict, ref: dict, default_container: str, node: NodeContext) -> str:
    name = ref.get("containerName") or default_container
    container = next(c for c in pod["spec"]["containers"] + (pod["spec"].get("initContainers") or [])
                     if c["name"] == name)
    kind, resource = ref["resource"].split(".", 1)
    resources = container.get("resources") or {}
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    value = limits.get(resource) if kind == "limits" else requests.get(resource, limits.get(resource))
    if value is None:
        value = node.allocatable.get(resource, "0")  # the kubelet's default: node allocatable
    divisor = quantity.parse(ref.get("divisor") or "1")
    return str(math.ceil(quantity.parse(value) / divisor))


async def container_env(pod: dict, container: dict, pod_ip: str, node: NodeContext, fetch: Fetch,
                        markers: dict[str, str], tmpdir: str = "") -> dict[str, str]:
    if (container.get("command") or [""])[0] == "vllm" and not node.vllm_bin:
        raise ContainerConfigError(f"the container runs `vllm`, which this node runs from the vLLM environment: "
                                   f"{node.vllm_missing}; then restart the node agent (`adpfleet cluster down`, `up`)")
    env = base_env(pod, node, tmpdir)
    for source in container.get("envFrom") or []:
        kind, ref = ("ConfigMap", source["configMapRef"]) if "configMapRef" in source \
            else ("Secret", source["secretRef"])
        data = await _data(fetch, kind, ref["name"], bool(ref.get("optional")))
        for key, value in data.items():
            name = source.get("prefix", "") + key
            if _ENV_NAME.match(name):
                env[name] = value
    for var in container.get("env") or []:
        if "value" in var or "valueFrom" not in var:
            env[var["name"]] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = field_ref(pod, source["fieldRef"]["fieldPath"], pod_ip, node.host_ip)
        elif "resourceFieldRef" in source:
            env[var["name"]] = resource_field_ref(pod, source["resourceFieldRef"], container["name"], node)
        else:
            kind, ref = ("ConfigMap", source["configMapKeyRef"]) if "configMapKeyRef" in source \
                else ("Secret", source["secretKeyRef"])
            data = await _data(fetch, kind, ref["name"], bool(ref.get("optional")))
            if ref["key"] in data:
                env[var["name"]] = data[ref["key"]]
            elif not ref.get("optional"):
                raise ContainerConfigError(f'couldn\'t find key {ref["key"]} in {kind} '
                                           f'{pod["metadata"]["namespace"]}/{ref["name"]}')
    env.update(markers)
    return env


def command_line(container: dict, env: dict[str, str]) -> list[str]:
    """command + args, expanded. The image is ignored, so a container without `command` cannot run."""
    command = container.get("command") or []
    if not command:
        raise ContainerConfigError(
            "the container has no `command`: the adpfleet node agent ignores images (it has no "
            "image entrypoint to fall back on), so give each container an explicit command")
    return [expand(part, env) for part in command + (container.get("args") or [])]


async def _data(fetch: Fetch, kind: str, name: str, optional: bool) -> dict[str, str]:
    obj = await fetch(kind, name)
    if obj is None:
        if optional:
            return {}
        raise ContainerConfigError(f'{kind.lower()} "{name}" not found')
    if kind == "Secret":
        return {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}
    return dict(obj.get("data") or {})
