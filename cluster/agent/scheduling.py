"""Does a pending pod fit on the node? The scheduler's filters that matter on one node.

Pure functions over plain dicts: `unschedulable_reason(pod, node, bound_pods)` returns None when
the pod fits, else the message the scheduler would put in a FailedScheduling event.
"""

from __future__ import annotations

from adpfleet.cluster.agent import quantity

# Taints the node lifecycle controller sets when the node agent stops heartbeating. The agent is
# also the scheduler, so while it schedules it is alive: these never block a binding.
_LIFECYCLE_TAINT_PREFIX = "node.kubernetes.io/"


def pod_requests(pod: dict) -> dict[str, float]:
    """Effective requests: the sum over containers, at least the largest init container."""
    spec = pod["spec"]

    def total(containers: list[dict]) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in containers:
            resources = c.get("resources") or {}
            # Defaulting copies limits into missing requests; extended resources only have limits.
            for name, value in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items():
                out[name] = out.get(name, 0.0) + quantity.parse(value)
        return out

    requests = total(spec.get("containers") or [])
    for init in spec.get("initContainers") or []:
        for name, value in total([init]).items():
            requests[name] = max(requests.get(name, 0.0), value)
    for name, value in (spec.get("overhead") or {}).items():
        requests[name] = requests.get(name, 0.0) + quantity.parse(value)
    return requests


def is_terminal(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def unschedulable_reason(pod: dict, node: dict, bound_pods: list[dict]) -> str | None:
    reasons = []
    labels = node["metadata"].get("labels") or {}
    selector = pod["spec"].get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()) or not _affinity_matches(pod, labels):
        reasons.append("node(s) didn't match Pod's node affinity/selector")
    untolerated = [t for t in node["spec"].get("taints") or []
                   if t["effect"] in ("NoSchedule", "NoExecute")
                   and not t["key"].startswith(_LIFECYCLE_TAINT_PREFIX)
                   and not _tolerated(t, pod["spec"].get("tolerations") or [])]
    if untolerated:
        reasons.append("node(s) had untolerated taint {%s: %s}" % (untolerated[0]["key"],
                                                                   untolerated[0].get("value", "")))
    allocatable = {k: quantity.parse(v) for k, v in node["status"].get("allocatable", {}).items()}
    live = [p for p in bound_pods if not is_terminal(p)]
    if len(live) + 1 > allocatable.get("pods", float("inf")):
        reasons.append("Too many pods")
    used: dict[str, float] = {}
    for other in live:
        for name, value in pod_requests(other).items():
            used[name] = used.get(name, 0.0) + value
    for name, value in sorted(pod_requests(pod).items()):
        if value > 0 and used.get(name, 0.0) + value > allocatable.get(name, 0.0):
            reasons.append(f"Insufficient {name}")
    if not reasons:
        return None
    return "0/1 nodes are available: " + ", ".join(f"1 {r}" for r in reasons) + "."


def _tolerated(taint: dict, tolerations: list[dict]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _affinity_matches(pod: dict, labels: dict) -> bool:
    required = (((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return True
    return any(all(_expression_matches(e, labels) for e in term.get("matchExpressions") or [])
               for term in terms)


def _expression_matches(expr: dict, labels: dict) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt") and key in labels:
        try:
            diff = int(labels[key]) - int(values[0])
        except ValueError:
            return False
        return diff > 0 if op == "Gt" else diff < 0
    return False
