"""Scaling a role against the real API server: through its InferenceFleetRole's scale subresource
(`kubectl scale`, a HorizontalPodAutoscaler) and through the built-in policy, reading synthetic
per-rank /metrics served on the status-only pods' own addresses (cluster/synthetic_metrics.py).
Scale-downs drain first: every pod a scale-down deleted carried the drain annotations when it went."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request

import pytest
from kubernetes import client, watch

from adpfleet.cluster.testing import wait_for
from adpfleet.operator.resource import names

from operator_harness import free_port, pod_ready
from specs import fleet_manifest

pytestmark = pytest.mark.k8s


def role(servers, **extra):
    return {"servers": servers, "adpRanks": 1, "engine": {"kvBlocks": 64}, "probes": {"readinessPeriodSeconds": 1},
            **extra}


class Deletions:
    """The last state of every server pod deleted while it runs (annotations included)."""

    def __init__(self, core, namespace: str):
        self.core, self.ns = core, namespace
        self.gone: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Deletions":
        self._version = self.core.list_namespaced_pod(self.ns).metadata.resource_version
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def of(self, *pods: str, timeout: float = 15) -> dict[str, dict]:
        """The last annotations of each of `pods`, once the watch has seen it deleted (a watch trails a
        list: a CI run listed a pod gone before its DELETED event came)."""
        wait_for(lambda: set(pods) <= self.gone.keys(), timeout=timeout, what=f"the watch to see {pods} deleted")
        return {name: self.gone[name] for name in pods}

    def _run(self) -> None:
        while not self._stop.is_set():
            for event in watch.Watch().stream(self.core.list_namespaced_pod, self.ns, label_selector=names.LABEL_ROLE,
                                              resource_version=self._version, timeout_seconds=1):
                pod = event["object"]
                self._version = pod.metadata.resource_version
                if event["type"] == "DELETED":
                    self.gone[pod.metadata.name] = dict(pod.metadata.annotations or {})


def role_object(fleets, name: str) -> dict:
    return fleets.custom.get_namespaced_custom_object(names.GROUP, names.VERSION, fleets.ns, names.ROLE_PLURAL, name)


def ready_servers(fleets, fleet: str, role_name: str) -> list[str]:
    return [p.metadata.name for p in fleets.live_pods(fleet, role_name) if pod_ready(p)
            and not (p.metadata.annotations or {}).get(names.ANNOTATION_SCALE_DOWN)]


def test_kubectl_scale_and_an_hpa_drive_a_role_through_its_scale_target(start_operator, fleets, k8s_cluster):
    start_operator()
    fleets.apply(fleet_manifest("demo", status_only=True, context=role(1), generation=role(1)))
    fleets.wait_ready("demo")
    ns = f"--namespace={fleets.ns}"
    table = k8s_cluster.kubectl("get", names.ROLE_SHORT_NAMES[0], ns).stdout
    assert table.split("\n")[0].split()[:6] == ["NAME", "FLEET", "ROLE", "DESIRED", "CURRENT", "READY"], table
    assert "demo-context" in table and "demo-generation" in table
    owner = role_object(fleets, "demo-context")["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("InferenceFleet", "demo", True)

    with Deletions(fleets.core, fleets.ns) as deletions:
        k8s_cluster.kubectl("scale", names.ROLE_SHORT_NAMES[0], "demo-context", "--replicas=3", ns)
        wait_for(lambda: len(ready_servers(fleets, "demo", "context")) == 3, timeout=60, what="three context servers")
        fleets.wait_ready("demo")  # Ready throughout: the status catches up with the new servers on its next pass
        wait_for(lambda: (lambda c: c.get("desired") == 3 and c.get("servers") == "3/3")(
            fleets.get("demo")["status"].get("context", {})), timeout=30, what="status context 3/3, desired 3")
        last = wait_for(lambda: role_object(fleets, "demo-context").get("status", {}).get("lastScale"), timeout=30,
                        what="the scale to be recorded")
        assert (last["previous"], last["desired"], last["reason"]) == (1, 3, "ScaledExternally")
        assert last["source"].startswith("kubectl"), last
        assert fleets.get("demo")["status"]["lastScale"] == last
        wait_for(lambda: fleets.events("ScaledUp"), timeout=30, what="a ScaledUp Event")
        wide = k8s_cluster.kubectl("get", names.SHORT_NAMES[0], "demo", "-o", "wide", ns).stdout
        assert "3/3" in wide and "Last Scale".upper() in wide.split("\n")[0], wide

        # the scale subresource refuses what the schema refuses
        refused = k8s_cluster.kubectl("scale", names.ROLE_SHORT_NAMES[0], "demo-context", "--replicas=0", ns,
                                      check=False)
        assert refused.returncode != 0 and "replicas" in refused.stderr, refused.stderr

        # scale down through the scale subresource: drained first, then deleted
        k8s_cluster.kubectl("scale", names.ROLE_SHORT_NAMES[0], "demo-context", "--replicas=1", ns)
        wait_for(lambda: [p.metadata.name for p in fleets.pods("demo", "context")] == ["demo-context-0"],
                 timeout=60, what="the scaled-down context servers to be gone")
        for name, last in deletions.of("demo-context-1", "demo-context-2").items():
            assert last.get(names.ANNOTATION_DRAIN) == "true", (name, last)
            assert last.get(names.ANNOTATION_SCALE_DOWN), (name, last)
        assert fleets.events("DrainingServer") and fleets.events("ScaledDown")

    # a change of the fleet's own count wins over the last scale
    fleets.patch_spec("demo", {"context": {"servers": 2}})
    wait_for(lambda: len(ready_servers(fleets, "demo", "context")) == 2, timeout=60, what="two context servers")
    scaled = role_object(fleets, "demo-context")
    assert scaled["spec"]["replicas"] == 2
    assert wait_for(lambda: role_object(fleets, "demo-context")["status"]["lastScale"]["reason"] == "SpecChanged",
                    timeout=30, what="SpecChanged")

    # an HPA accepts the InferenceFleetRole as its target and reads its scale (there is no metrics
    # server here, so it cannot compute a recommendation: the scaling itself went through kubectl)
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "demo-generation", "namespace": fleets.ns},
           "spec": {"scaleTargetRef": {"apiVersion": names.API_VERSION, "kind": names.ROLE_KIND,
                                       "name": "demo-generation"},
                    "minReplicas": 1, "maxReplicas": 4,
                    "metrics": [{"type": "Pods", "pods": {
                        "metric": {"name": "adpfleet_requests_waiting"},
                        "target": {"type": "AverageValue", "averageValue": "2"}}}]}}
    k8s_cluster.apply(hpa, namespace=fleets.ns)

    def read_scale():
        got = k8s_cluster.get_json("hpa", "demo-generation", ns)
        conditions = {c["type"]: c for c in got.get("status", {}).get("conditions", [])}
        able = conditions.get("AbleToScale", {})
        return got if able.get("status") == "True" and able.get("reason") == "SucceededGetScale" else None
    got = wait_for(read_scale, timeout=90, what="the HPA to read the InferenceFleetRole's scale", interval=1)
    assert got["status"]["currentReplicas"] == 1
    selector = role_object(fleets, "demo-generation")["status"]["selector"]
    assert selector == "adpfleet.io/fleet=demo,adpfleet.io/role=generation"


@pytest.fixture
def synthetic_metrics(k8s_cluster, k8s_namespace):
    """Synthetic servers on the namespace's status-only pods; a function that posts to its control."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "adpfleet.cluster.synthetic_metrics", "--kubeconfig",
                             str(k8s_cluster.kubeconfig), "--namespace", k8s_namespace, "--control-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert "control on" in proc.stdout.readline()

    def post(path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body or {}).encode(),
                                         method="POST" if body is not None else "GET")
        with urllib.request.urlopen(request, timeout=5) as r:
            return json.loads(r.read())
    yield post
    proc.terminate()
    proc.wait(10)


def test_the_built_in_policy_scales_a_role_up_on_its_queue_and_down_again_draining_first(
        start_operator, fleets, synthetic_metrics):
    op = start_operator()
    scaling = {"enabled": True, "minServers": 1, "maxServers": 3, "targets": {"waitingPerRank": 2},
               "scaleUp": {"stabilizationWindowSeconds": 2, "maxServersPerStep": 1},
               "scaleDown": {"stabilizationWindowSeconds": 4, "maxServersPerStep": 1}}
    fleets.apply(fleet_manifest("auto", status_only=True, context=role(1),
                                generation=role(1, autoscaling=scaling, drainTimeoutSeconds=30),
                                monitoring={"scrapeIntervalSeconds": 1},
                                remediation={"stallWindowSeconds": 4}))
    fleets.wait_ready("auto")
    wait_for(lambda: "auto-generation-0" in synthetic_metrics("/pods"), timeout=30, what="a synthetic server")

    with Deletions(fleets.core, fleets.ns) as deletions:
        # six requests waiting per rank: every server added still shows them (the load does not move
        # here), so the role grows a server at a time up to maxServers
        synthetic_metrics("/load", {"fleet": "auto", "role": "generation", "waiting": 6, "running": 2})
        wait_for(lambda: len(ready_servers(fleets, "auto", "generation")) == 3, timeout=90,
                 what="the policy to scale generation to maxServers", interval=0.5)
        # the fleet's status follows the role's on its next reconcile: a Ready fleet read here may
        # still be the one that counted two servers
        def counted():
            counts = fleets.get("auto")["status"]["generation"]
            return (counts["desired"], counts["ready"]) == (3, 3)
        wait_for(counted, timeout=30, what="the fleet's status to count three Ready generation servers",
                 interval=0.25)
        fleets.wait_ready("auto")
        last = role_object(fleets, "auto-generation")["status"]["lastScale"]
        assert (last["reason"], last["source"], last["desired"]) == ("WaitingAboveTarget", "policy", 3), last
        assert "waiting/rank 6 > target 2" in last["message"]
        assert op.metric("adpfleet_operator_scaling_decisions_total", role="generation",
                         reason="WaitingAboveTarget") == 2
        assert len(fleets.pods("auto", "context")) == 1  # the other role keeps its count

        # the queue empties: back to one server, a step at a time, each drained before it goes
        synthetic_metrics("/load", {"fleet": "auto", "role": "generation", "waiting": 0, "running": 1, "kv": 0.1})
        wait_for(lambda: [p.metadata.name for p in fleets.pods("auto", "generation")] == ["auto-generation-0"],
                 timeout=90, what="the policy to scale generation back to one server", interval=0.5)
        for name, last in deletions.of("auto-generation-1", "auto-generation-2").items():
            assert last.get(names.ANNOTATION_SCALE_DOWN), (name, last)
        last = role_object(fleets, "auto-generation")["status"]["lastScale"]
        assert (last["reason"], last["desired"]) == ("BelowTargets", 1)
    assert op.metric("adpfleet_operator_scale_changes_total", role="generation", reason="BelowTargets") == 2
    # no server being scaled down was taken for a stalled one
    assert op.metric("adpfleet_operator_stalls_detected_total") == 0
    assert not fleets.get("auto")["status"].get("recentRemediations")
