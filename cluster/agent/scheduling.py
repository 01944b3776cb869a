"""Does a pending pod fit on the node? The scheduler's filters that matter on one node.

Pure functions over plain dicts: `unschedulable_reason(pod, node, bound_pods)` returns None when
the pod fits, else the message the scheduler would put in a FailedScheduling event.
"""

from __future__ import annotations

from decimal import Decimal

from adpfleet.contract import quantity
from adpfleet.contract.pod_requests import add_requests, pod_requests

# Taints the node lifecycle controller sets when the node agent stops heartbeating. The agent is
# also the scheduler, so while it schedules it is alive: these never block a binding.
_LIFECYCLE_TAINT_PREFIX = "node.kubernetes.io/"
DEFAULT_SCHEDULER = "default-scheduler"


def is_terminal(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def unschedulable_reason(pod: dict, node: dict, bound_pods: list[dict]) -> str | None:
    reasons = []
    labels = node["metadata"].get("labels") or {}
    selector = pod["spec"].get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()) or not _affinity_matches(pod, node):
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
    if "pods" in allocatable and len(live) + 1 > allocatable["pods"]:
        reasons.append("Too many pods")
    used: dict[str, Decimal] = {}
    for other in live:
        add_requests(used, pod_requests(other["spec"]))
    for name, value in sorted(pod_requests(pod["spec"]).items()):
        if value > 0 and used.get(name, 0) + value > allocatable.get(name, 0):
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


def _affinity_matches(pod: dict, node: dict) -> bool:
    required = (((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))
    return required is None or node_selector_matches(required, node)


def node_selector_matches(selector: dict, node: dict) -> bool:
    """A NodeSelector (pod node affinity, PersistentVolume node affinity): the terms are ORed, the
    requirements of a term ANDed; a term with no requirement matches nothing, like the API says."""
    labels = node["metadata"].get("labels") or {}
    fields = {"metadata.name": node["metadata"].get("name", "")}
    for term in selector.get("nodeSelectorTerms") or []:
        expressions, field_terms = term.get("matchExpressions") or [], term.get("matchFields") or []
        if (expressions or field_terms) and all(_expression_matches(e, labels) for e in expressions) \
                and all(_expression_matches(f, fields) for f in field_terms):
            return True
    return False


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


def label_selector_matches(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector (matchLabels and matchExpressions ANDed); no selector matches everything."""
    if not selector:
        return True
    return (all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())
            and all(_expression_matches(e, labels) for e in selector.get("matchExpressions") or []))


def ignored_constraints(pod: dict) -> list[str]:
    """What of the pod's scheduling spec one local node cannot honour (each becomes an Event)."""
    spec = pod["spec"]
    ignored = []
    scheduler = spec.get("schedulerName") or DEFAULT_SCHEDULER
    if scheduler != DEFAULT_SCHEDULER:
        ignored.append(f'schedulerName "{scheduler}": no such scheduler runs in the local cluster; '
                       "the node agent scheduled the pod in its place")
    affinity = spec.get("affinity") or {}
    for kind in ("podAffinity", "podAntiAffinity"):
        if affinity.get(kind):
            ignored.append(f"affinity.{kind} is not evaluated: the local cluster has one node")
    if spec.get("topologySpreadConstraints"):
        ignored.append("topologySpreadConstraints are not evaluated: the local cluster has one node")
    return ignored
