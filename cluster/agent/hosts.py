"""Cluster DNS names for pods, answered through each pod's own `/etc/hosts`.

On a real cluster a pod with `spec.hostname: web-0` and `spec.subdomain: web`, selected by a
headless Service named `web` in namespace `ns`, is reachable as `web-0.web.ns.svc.cluster.local`
(CoreDNS answers from the Service's EndpointSlices), and the pod's search path
(`ns.svc.cluster.local svc.cluster.local cluster.local`) makes `web-0.web` and `web-0.web.ns` work
too. The local cluster has no DNS server, and the API server refuses loopback pod addresses in
EndpointSlices, so the node agent answers the same names itself: each pod's `/etc/hosts` (bind-
mounted in its private mount namespace) holds the kubelet's lines for the pod itself and one line
per name CoreDNS would answer, with the short forms the pod's search path would expand. The agent
rewrites the file in place as pods and Services come and go; glibc reads it on every lookup.

What CoreDNS would answer, for each headless Service (`clusterIP: None`) with a selector, over the
pods the EndpointSlice controller would list for it (same namespace, labels match, an IP, not
finished; ready — unless the Service sets `publishNotReadyAddresses` — and not being deleted):
    <service>.<namespace>.svc.cluster.local             every such pod's address
    <hostname>.<service>.<namespace>.svc.cluster.local  a pod whose spec.subdomain is the Service
Not answered: ClusterIP Services (no kube-proxy routes a cluster IP here), ExternalName Services,
SRV records, pod A records by dashed IP.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

CLUSTER_DOMAIN = "cluster.local"
SERVICE_SUFFIX = f".svc.{CLUSTER_DOMAIN}"
Records = dict[str, list[str]]  # fully qualified name -> addresses, in a stable order

_KUBELET_LINES = """# Kubernetes-managed hosts file (adpfleet node agent).
127.0.0.1\tlocalhost
::1\tlocalhost ip6-localhost ip6-loopback
fe00::0\tip6-localnet
fe00::0\tip6-mcastprefix
fe00::1\tip6-allnodes
fe00::2\tip6-allrouters
"""


def pod_hostname(pod: dict) -> str:
    """The kubelet's: spec.hostname, else the pod's name cut to 63 characters."""
    return pod["spec"].get("hostname") or pod["metadata"]["name"][:63].rstrip("-.")


def pod_fqdn(pod: dict) -> str | None:
    subdomain = pod["spec"].get("subdomain")
    if not subdomain:
        return None
    return f"{pod_hostname(pod)}.{subdomain}.{pod['metadata']['namespace']}{SERVICE_SUFFIX}"


def dns_view(pod: dict) -> tuple:
    """What of a pod the records depend on: a pod change that leaves this equal changes no name."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    return (meta["namespace"], tuple(sorted((meta.get("labels") or {}).items())), status.get("podIP"),
            _ready(pod), bool(meta.get("deletionTimestamp")), status.get("phase"), spec.get("hostname"),
            spec.get("subdomain"))


def service_records(services: Iterable[dict], pods: Iterable[dict]) -> Records:
    by_namespace: dict[str, list[dict]] = {}
    for pod in pods:
        by_namespace.setdefault(pod["metadata"]["namespace"], []).append(pod)
    records: Records = {}
    for service in services:
        spec, meta = service.get("spec") or {}, service["metadata"]
        selector = spec.get("selector")
        if spec.get("clusterIP") != "None" or not selector:
            continue
        name, namespace = meta["name"], meta["namespace"]
        publish = bool(spec.get("publishNotReadyAddresses"))
        for pod in by_namespace.get(namespace, []):
            labels = pod["metadata"].get("labels") or {}
            if any(labels.get(k) != v for k, v in selector.items()) or not _in_endpoints(pod, publish):
                continue
            ip = pod["status"]["podIP"]
            records.setdefault(f"{name}.{namespace}{SERVICE_SUFFIX}", []).append(ip)
            if pod["spec"].get("hostname") and pod["spec"].get("subdomain") == name:
                records.setdefault(f"{pod['spec']['hostname']}.{name}.{namespace}{SERVICE_SUFFIX}", []).append(ip)
    return {fqdn: sorted(set(ips)) for fqdn, ips in sorted(records.items())}


def hosts_file(pod: dict, ip: str, records: Records) -> str:
    namespace = pod["metadata"]["namespace"]
    fqdn = pod_fqdn(pod)
    own = f"{ip}\t{fqdn}\t{pod_hostname(pod)}" if fqdn else f"{ip}\t{pod_hostname(pod)}"
    lines = [_KUBELET_LINES + own]
    aliases = pod["spec"].get("hostAliases") or []
    if aliases:
        lines.append("# Entries added by HostAliases.")
        lines += [f"{a['ip']}\t{' '.join(a.get('hostnames') or [])}" for a in aliases]
    if records:
        lines.append(f"# Headless Services (search: {namespace}{SERVICE_SUFFIX} svc.{CLUSTER_DOMAIN} "
                     f"{CLUSTER_DOMAIN}).")
        lines += [f"{address}\t{' '.join(names_seen_from(name, namespace))}"
                  for name, addresses in records.items() for address in addresses]
    return "\n".join(lines) + "\n"


def names_seen_from(fqdn: str, namespace: str) -> list[str]:
    """`fqdn` and every shorter name that the pod's DNS search path would expand to it."""
    base = fqdn.removesuffix(SERVICE_SUFFIX)  # <name>.<namespace>
    names = [fqdn, f"{base}.svc", base]
    if base.endswith(f".{namespace}"):
        names.append(base.removesuffix(f".{namespace}"))
    return names


def rewrite_in_place(path: Path, text: str) -> None:
    """Replace the file's content without replacing the file: a bind mount pins the inode, so a
    rename would never be seen inside the pod. The content is written in one write() and never
    truncated first (a shorter text is padded with blank lines), so a concurrent lookup reads the
    old or the new names, never an empty file."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        os.pwrite(fd, data + b"\n" * max(0, size - len(data)), 0)
    finally:
        os.close(fd)


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _in_endpoints(pod: dict, publish_not_ready: bool) -> bool:
    """The EndpointSlice controller's rule, and CoreDNS answering only ready endpoints."""
    status = pod.get("status") or {}
    if not status.get("podIP") or status.get("phase") in ("Succeeded", "Failed"):
        return False
    if publish_not_ready:
        return True
    return _ready(pod) and not pod["metadata"].get("deletionTimestamp")
