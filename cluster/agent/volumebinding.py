"""The scheduler's VolumeBinding filter on one node: may a pod with PersistentVolumeClaims run here?

A claim must exist and not be being deleted. A bound claim's volume must allow this node (its
`nodeAffinity`). An unbound claim is left to the kube-controller-manager's PersistentVolume binder,
except in a StorageClass with `volumeBindingMode: WaitForFirstConsumer`: there, like the
scheduler, the agent picks the smallest Available PersistentVolume that fits the claim (class,
access modes, volume mode, size, selector, node affinity) and pre-binds it by setting its
`claimRef`; the binder completes the binding and the pod is bound to the node once its claims are.
Dynamic provisioning is not done: no provisioner runs in the local cluster.

Pure functions over plain dicts; `check_claims` returns what to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adpfleet.cluster.agent.scheduling import label_selector_matches, node_selector_matches
from adpfleet.contract import quantity


@dataclass
class ClaimCheck:
    problem: str | None = None                                  # the scheduler's words, for FailedScheduling
    prebind: list[tuple[dict, dict]] = field(default_factory=list)  # (volume, claim): set the volume's claimRef
    binding: bool = False                                       # a claim's binding is under way: wait for it


def claim_names(pod: dict) -> list[str]:
    return [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"].get("volumes") or []
            if "persistentVolumeClaim" in v]


def check_claims(pod: dict, claims: dict[tuple[str, str], dict], volumes: dict[str, dict],
                 classes: dict[str, dict], node: dict, taken: set[str]) -> ClaimCheck:
    """`claims` by (namespace, name), `volumes` and `classes` by name; `taken`: volumes pre-bound
    earlier in this pass (not offered twice; the volumes this pod is to pre-bind are added)."""
    namespace = pod["metadata"]["namespace"]
    check = ClaimCheck()
    unbound_immediate = []
    chosen: set[str] = set()
    for name in claim_names(pod):
        claim = claims.get((namespace, name))
        if claim is None:
            return ClaimCheck(f'persistentvolumeclaim "{name}" not found')
        if claim["metadata"].get("deletionTimestamp"):
            return ClaimCheck(f'persistentvolumeclaim "{name}" is being deleted')
        if (claim.get("status") or {}).get("phase") == "Bound":
            volume = volumes.get(claim["spec"].get("volumeName", ""))
            affinity = ((volume or {}).get("spec") or {}).get("nodeAffinity", {}).get("required")
            if affinity and not node_selector_matches(affinity, node):
                return ClaimCheck("1 node(s) had volume node affinity conflict")
            continue
        storage_class = classes.get(claim["spec"].get("storageClassName") or "")
        if (storage_class or {}).get("volumeBindingMode") != "WaitForFirstConsumer":
            unbound_immediate.append(name)
            continue
        if claim["spec"].get("volumeName") or any(_claimed_by(v, claim) for v in volumes.values()):
            check.binding = True  # pre-bound (by us, in an earlier pass): the binder completes it
            continue
        volume = best_volume(claim, volumes.values(), node, taken | chosen)
        if volume is None:
            return ClaimCheck(f'1 node(s) didn\'t find available persistent volumes to bind (claim "{name}")')
        chosen.add(volume["metadata"]["name"])
        check.prebind.append((volume, claim))
    if unbound_immediate:
        names = ", ".join(f'"{n}"' for n in unbound_immediate)
        return ClaimCheck(f"pod has unbound immediate PersistentVolumeClaims ({names})")
    taken |= chosen
    return check


def _claimed_by(volume: dict, claim: dict) -> bool:
    ref = volume["spec"].get("claimRef") or {}
    return ref.get("uid") == claim["metadata"]["uid"]


def best_volume(claim: dict, volumes, node: dict, taken: set[str]) -> dict | None:
    """The smallest Available volume that satisfies the claim, as the PV binder chooses."""
    spec = claim["spec"]
    wanted = quantity.parse(((spec.get("resources") or {}).get("requests") or {}).get("storage", "0"))
    fits = []
    for volume in volumes:
        vspec = volume["spec"]
        ref = vspec.get("claimRef")
        free = (volume.get("status") or {}).get("phase") == "Available" and not ref
        mine = bool(ref) and ref.get("name") == claim["metadata"]["name"] \
            and ref.get("namespace") == claim["metadata"]["namespace"]
        if volume["metadata"]["name"] in taken or not (free or mine):
            continue
        size = quantity.parse((vspec.get("capacity") or {}).get("storage", "0"))
        affinity = (vspec.get("nodeAffinity") or {}).get("required")
        if ((vspec.get("storageClassName") or "") == (spec.get("storageClassName") or "")
                and set(spec.get("accessModes") or []) <= set(vspec.get("accessModes") or [])
                and vspec.get("volumeMode", "Filesystem") == spec.get("volumeMode", "Filesystem")
                and size >= wanted
                and label_selector_matches(spec.get("selector"), volume["metadata"].get("labels") or {})
                and (not affinity or node_selector_matches(affinity, node))):
            fits.append((size, volume["metadata"]["name"], volume))
    return min(fits, key=lambda f: f[:2])[2] if fits else None


def claim_ref(claim: dict) -> dict:
    meta = claim["metadata"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": meta["namespace"],
            "name": meta["name"], "uid": meta["uid"], "resourceVersion": meta["resourceVersion"]}
