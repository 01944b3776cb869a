"""Pods bound to the node agent are real processes: addressed, probed, restarted, stopped."""

import signal
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest

from adpfleet.cluster import processes
from adpfleet.cluster.testing import http_server_pod, pod_manifest, wait_for

pytestmark = pytest.mark.k8s


def pod_processes(uid: str) -> list:
    return processes.processes_with_env("ADPFLEET_POD_UID", uid)


def http_get(ip: str, port: int, path: str = "/") -> int:
    with urllib.request.urlopen(f"http://{ip}:{port}{path}", timeout=5) as response:
        return response.status


def container_status(pod):
    return pod.status.container_statuses[0]


def logs(cluster, ns: str, name: str) -> str:
    return cluster.kubectl("logs", name, "-n", ns).stdout


def test_a_pod_becomes_ready_with_its_own_loopback_ip_reachable_over_http(k8s_cluster, k8s_namespace):
    k8s_cluster.apply(http_server_pod("web"), k8s_namespace)
    pod = k8s_cluster.wait_for_pod(k8s_namespace, "web")
    ip = pod.status.pod_ip
    assert ip.startswith("127.") and ip != "127.0.0.1"
    assert [p.ip for p in pod.status.pod_ips] == [ip]
    assert pod.status.phase == "Running" and container_status(pod).started
    assert http_get(ip, 8080) == 200


def test_two_pods_listen_on_the_same_port_at_different_ips(k8s_cluster, k8s_namespace):
    k8s_cluster.apply([http_server_pod("a"), http_server_pod("b")], k8s_namespace)
    a, b = (k8s_cluster.wait_for_pod(k8s_namespace, n) for n in ("a", "b"))
    assert a.status.pod_ip != b.status.pod_ip
    assert http_get(a.status.pod_ip, 8080) == http_get(b.status.pod_ip, 8080) == 200


LIVE_FOR_TWO_PROBES = """
import http.server, os
hits = 0
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global hits
        hits += 1
        self.send_response(200 if hits <= 2 else 500)
        self.end_headers()
http.server.HTTPServer((os.environ["POD_IP"], 8080), Handler).serve_forever()
"""


def test_a_failing_liveness_probe_restarts_the_container_and_counts_the_restart(k8s_cluster, k8s_namespace):
    liveness = {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1, "failureThreshold": 2}
    k8s_cluster.apply(pod_manifest("flaky", ["python3", "-c", LIVE_FOR_TWO_PROBES],
                                   container={"livenessProbe": liveness}), k8s_namespace)
    pod = k8s_cluster.wait_for_pod(k8s_namespace, "flaky", lambda p: container_status(p).restart_count >= 1,
                                   timeout=30, what="a liveness restart")
    last = container_status(pod).last_state.terminated
    assert last is not None and last.exit_code == 143  # SIGTERM'd: 128 + 15
    events = k8s_cluster.kubectl("get", "events", "-n", k8s_namespace, "--field-selector",
                                 "involvedObject.name=flaky", "-o", "custom-columns=R:.reason,M:.message").stdout
    assert "failed liveness probe, will be restarted" in events
    assert "Liveness probe failed: HTTP probe failed with statuscode: 500" in events


def test_deleting_a_pod_sigkills_what_ignores_sigterm_once_the_grace_period_is_over(k8s_cluster, k8s_namespace):
    stubborn = pod_manifest("stubborn", ["sh", "-c", "trap '' TERM; sleep 1000 & sleep 1000 & wait"],
                            terminationGracePeriodSeconds=2)
    k8s_cluster.apply(stubborn, k8s_namespace)
    pod = k8s_cluster.wait_for_pod(k8s_namespace, "stubborn")
    assert len(wait_for(lambda: len(pod_processes(pod.metadata.uid)) == 3 and pod_processes(pod.metadata.uid),
                        timeout=10, what="the shell and its two sleeps")) == 3
    started = time.monotonic()
    k8s_cluster.core.delete_namespaced_pod("stubborn", k8s_namespace)
    wait_for(lambda: not pod_processes(pod.metadata.uid), timeout=10, what="every process of the pod to exit")
    elapsed = time.monotonic() - started
    assert 1.5 < elapsed < 2 + 2.0, f"stopped after {elapsed:.1f} s with a 2 s grace period"
    k8s_cluster.wait_for_pod_gone(k8s_namespace, "stubborn", timeout=5)


def test_deleting_a_pod_whose_server_exits_on_sigterm_is_quick(k8s_cluster, k8s_namespace):
    k8s_cluster.apply(http_server_pod("web", terminationGracePeriodSeconds=30), k8s_namespace)
    pod = k8s_cluster.wait_for_pod(k8s_namespace, "web")
    started = time.monotonic()
    k8s_cluster.core.delete_namespaced_pod("web", k8s_namespace)
    k8s_cluster.wait_for_pod_gone(k8s_namespace, "web", timeout=10)
    assert not pod_processes(pod.metadata.uid)
    assert time.monotonic() - started < 5


def test_a_crashing_container_restarts_with_growing_back_off(k8s_cluster, k8s_namespace):
    k8s_cluster.apply(pod_manifest("crasher", ["sh", "-c", "echo crashing; exit 3"]), k8s_namespace)
    seen: dict[int, float] = {}
    reasons = set()

    def restarted_four_times():
        status = container_status(k8s_cluster.core.read_namespaced_pod("crasher", k8s_namespace))
        seen.setdefault(status.restart_count, time.monotonic())
        if status.state.waiting:
            reasons.add(status.state.waiting.reason)
        return status.restart_count >= 4 and status

    status = wait_for(restarted_four_times, timeout=40, what="4 restarts", interval=0.05)
    assert status.last_state.terminated.exit_code == 3
    assert "CrashLoopBackOff" in reasons
    # Test agents back off 1 s, 2 s, 4 s ... (the kubelet's 10 s doubling, scaled down).
    first_gap, third_gap = seen[2] - seen[1], seen[4] - seen[3]
    assert third_gap > 2.5 * first_gap and third_gap > 3, f"gaps {first_gap:.1f} s then {third_gap:.1f} s"
    assert "crashing" in logs(k8s_cluster, k8s_namespace, "crasher")


def test_a_missing_command_is_a_start_error_in_back_off_while_other_pods_run(k8s_cluster, k8s_namespace):
    k8s_cluster.apply([pod_manifest("broken", ["adpfleet-no-such-command", "--flag"]), http_server_pod("fine")],
                      k8s_namespace)

    def start_error_twice(pod):
        status = container_status(pod)
        terminated = status.last_state.terminated
        return status.restart_count >= 2 and terminated and terminated.reason == "StartError"

    pod = k8s_cluster.wait_for_pod(k8s_namespace, "broken", start_error_twice, timeout=30, what="StartError restarts")
    message = container_status(pod).last_state.terminated.message
    assert message == 'exec: "adpfleet-no-such-command": executable file not found in $PATH'
    fine = k8s_cluster.wait_for_pod(k8s_namespace, "fine")
    assert http_get(fine.status.pod_ip, 8080) == 200


def test_downward_api_values_and_expanded_args_reach_the_process(k8s_cluster, k8s_namespace):
    script = 'echo "ip=$POD_IP name=$POD_NAME ns=$POD_NAMESPACE tier=$TIER arg=$0"; exec sleep 3600'
    env = [{"name": "TIER", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['tier']"}}}]
    k8s_cluster.apply(pod_manifest("env", ["sh", "-c", script, "$(POD_NAME)-in-$(POD_NAMESPACE)"], env=env,
                                   metadata={"labels": {"tier": "context"}}), k8s_namespace)
    pod = k8s_cluster.wait_for_pod(k8s_namespace, "env")
    line = wait_for(lambda: logs(k8s_cluster, k8s_namespace, "env").strip(), timeout=10, what="the env line")
    assert line == (f"ip={pod.status.pod_ip} name=env ns={k8s_namespace} tier=context "
                    f"arg=env-in-{k8s_namespace}")


def test_config_map_and_secret_volumes_are_readable_read_only_at_their_mount_paths(k8s_cluster, k8s_namespace):
    ns = k8s_namespace
    k8s_cluster.apply([{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
                        "data": {"greeting": "hello from a configmap"}},
                       {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"},
                        "stringData": {"password": "s3cret"}}], ns)
    script = ("cat /etc/adpfleet-test/config/greeting; echo; cat /etc/adpfleet-test/secret/password; echo; "
              "touch /etc/adpfleet-test/config/new 2>/dev/null || echo read-only; exec sleep 3600")
    pod = pod_manifest("reader", ["sh", "-c", script], container={"volumeMounts": [
        {"name": "cfg", "mountPath": "/etc/adpfleet-test/config"},
        {"name": "creds", "mountPath": "/etc/adpfleet-test/secret"}]},
        volumes=[{"name": "cfg", "configMap": {"name": "cfg"}}, {"name": "creds", "secret": {"secretName": "creds"}}])
    k8s_cluster.apply(pod, ns)
    k8s_cluster.wait_for_pod(ns, "reader")
    out = wait_for(lambda: (text := logs(k8s_cluster, ns, "reader")).count("\n") >= 3 and text,
                   timeout=10, what="three lines of output")
    assert out.splitlines() == ["hello from a configmap", "s3cret", "read-only"]
    # Mounted in the pod's own mount namespace only: the host's directory stays empty.
    import os
    assert os.listdir("/etc/adpfleet-test/config") == []


IN_CLUSTER_CLIENT = """
import os
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
config.load_incluster_config()
api = client.CoreV1Api()
ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
print("pods:", sorted(p.metadata.name for p in api.list_namespaced_pod(ns).items))
try:
    api.list_namespaced_secret(ns)
    print("secrets: allowed")
except ApiException as exc:
    print("secrets: denied", exc.status)
"""


def test_the_official_client_in_cluster_gets_exactly_what_its_role_allows(k8s_cluster, k8s_namespace):
    ns = k8s_namespace
    k8s_cluster.apply([
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "pod-reader"},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "reader"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
         "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}]}], ns)
    k8s_cluster.apply(pod_manifest("client", ["python", "-c", IN_CLUSTER_CLIENT], serviceAccountName="reader",
                                   restartPolicy="Never"), ns)
    k8s_cluster.wait_for_pod(ns, "client", lambda p: p.status.phase in ("Succeeded", "Failed"), timeout=60,
                             what="the client to finish")
    assert logs(k8s_cluster, ns, "client").splitlines() == ["pods: ['client']", "secrets: denied 403"]


def test_a_pod_that_cannot_fit_is_refused_with_a_clear_event(k8s_cluster, k8s_namespace):
    greedy = pod_manifest("greedy", ["sleep", "3600"], container={"resources": {"limits": {"nvidia.com/gpu": "100"}}})
    k8s_cluster.apply(greedy, k8s_namespace)
    pod = k8s_cluster.wait_for_pod(
        k8s_namespace, "greedy",
        lambda p: any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in p.status.conditions or []),
        what="PodScheduled=False/Unschedulable")
    assert pod.spec.node_name is None
    events = k8s_cluster.kubectl("get", "events", "-n", k8s_namespace, "-o", "custom-columns=R:.reason,M:.message").stdout
    assert "FailedScheduling   0/1 nodes are available: 1 Insufficient nvidia.com/gpu." in events


def test_status_only_pods_are_reported_ready_without_running_anything(k8s_cluster, k8s_namespace):
    ghost = pod_manifest("ghost", ["adpfleet-no-such-command"],
                         metadata={"annotations": {"adpfleet.io/node-agent": "status-only"}})
    k8s_cluster.apply(ghost, k8s_namespace)
    pod = k8s_cluster.wait_for_pod(k8s_namespace, "ghost")
    assert pod.status.pod_ip.startswith("127.") and container_status(pod).state.running
    assert not pod_processes(pod.metadata.uid)


def test_init_containers_finish_before_the_container_starts_and_share_its_empty_dir(k8s_cluster, k8s_namespace):
    mount = [{"name": "shared", "mountPath": "/data/adpfleet-test/shared"}]
    pod = pod_manifest("staged", ["sh", "-c", "cat /data/adpfleet-test/shared/greeting; exec sleep 3600"],
                       container={"volumeMounts": mount}, volumes=[{"name": "shared", "emptyDir": {}}],
                       initContainers=[{"name": "prepare", "image": "ignored", "volumeMounts": mount,
                                        "command": ["sh", "-c", "echo prepared > /data/adpfleet-test/shared/greeting"]}])
    k8s_cluster.apply(pod, k8s_namespace)
    pod = k8s_cluster.wait_for_pod(k8s_namespace, "staged")
    init = pod.status.init_container_statuses[0]
    assert init.state.terminated.exit_code == 0 and init.state.terminated.reason == "Completed"
    assert wait_for(lambda: logs(k8s_cluster, k8s_namespace, "staged").strip(), timeout=10,
                    what="the greeting") == "prepared"


def test_a_startup_probe_holds_back_readiness_until_it_passes_inside_the_pods_mounts(k8s_cluster, k8s_namespace):
    startup = {"exec": {"command": ["test", "-f", "/flags/started"]}, "periodSeconds": 1, "failureThreshold": 60}
    pod = pod_manifest("slow", ["sleep", "3600"], volumes=[{"name": "flags", "emptyDir": {}}],
                       container={"startupProbe": startup, "volumeMounts": [{"name": "flags", "mountPath": "/flags"}]})
    k8s_cluster.apply(pod, k8s_namespace)
    pod = k8s_cluster.wait_for_pod(k8s_namespace, "slow", lambda p: p.status.container_statuses
                                   and p.status.container_statuses[0].state.running, what="the process to run")
    assert not container_status(pod).started and not container_status(pod).ready
    # The flag appears in the pod's emptyDir, which on the host lives in the pod's directory.
    volume = k8s_cluster.plane.agent_dir / "pods" / f"{k8s_namespace}_slow_{pod.metadata.uid}" / "volumes" / "flags"
    (volume / "started").touch()
    pod = k8s_cluster.wait_for_pod(k8s_namespace, "slow", timeout=10)
    assert container_status(pod).started


def test_each_container_has_a_tmpdir_of_its_own_that_goes_with_the_pod(k8s_cluster, k8s_namespace):
    # vLLM binds IPC sockets in TMPDIR: in a container /tmp is its own, here it would be the host's;
    # and a socket's path must fit in 108 bytes, which the pod directory's path does not.
    k8s_cluster.apply(pod_manifest("scratch", ["sh", "-c", 'touch "$TMPDIR/ipc.sock" && echo "$TMPDIR" && sleep 1000']),
                      k8s_namespace)
    pod = k8s_cluster.wait_for_pod(k8s_namespace, "scratch")
    tmpdir = Path(wait_for(lambda: logs(k8s_cluster, k8s_namespace, "scratch").strip(), timeout=10, what="TMPDIR"))
    where = tmpdir.resolve()
    assert where.name == "main" and pod.metadata.uid in str(where) and (where / "ipc.sock").exists()
    assert len(f"{tmpdir}/{uuid.uuid4()}") < 108
    k8s_cluster.core.delete_namespaced_pod("scratch", k8s_namespace)
    k8s_cluster.wait_for_pod_gone(k8s_namespace, "scratch", timeout=10)
    # the agent deletes the object, then removes the pod's directory (docs/cluster.md): moments apart
    wait_for(lambda: not where.exists() and not tmpdir.is_symlink(), timeout=10,
             what="the pod's tmp directory and its link to go")


def test_the_node_signals_a_pods_process_by_its_title_even_one_that_left_the_pods_environment(k8s_cluster,
                                                                                              k8s_namespace):
    # vLLM's engine retitles itself VLLM::EngineCore, and retitling may overwrite the environment
    # that marks a pod's processes: the engine is found under the pod's main process instead.
    engine = "env -u ADPFLEET_POD_UID bash -c 'exec -a VLLM::EngineCore sleep 1000' & wait"
    k8s_cluster.apply(pod_manifest("engine", ["bash", "-c", engine]), k8s_namespace)
    uid = k8s_cluster.wait_for_pod(k8s_namespace, "engine").metadata.uid
    frozen = wait_for(lambda: processes.signal_pod_processes(uid, "VLLM::EngineCore", signal.SIGSTOP), timeout=10,
                      what="the engine process to start")
    wait_for(lambda: psutil.Process(frozen[0]).status() == psutil.STATUS_STOPPED, timeout=5, what="the freeze")
    assert processes.signal_pod_processes(uid, "VLLM::EngineCore", signal.SIGCONT) == frozen
    wait_for(lambda: psutil.Process(frozen[0]).status() != psutil.STATUS_STOPPED, timeout=5, what="the thaw")
    with pytest.raises(LookupError, match=r"no process titled 'VLLM::Worker'.*VLLM::EngineCore"):
        processes.signal_pod_processes(uid, "VLLM::Worker", signal.SIGSTOP)
