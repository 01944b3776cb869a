"""Containers as the kubelet runs them: init containers in order with its failure rules, sidecars,
termination messages, lifecycle hooks, and graceful deletion ending in the phase the exits earned."""

import threading

import pytest

from adpfleet.cluster.testing import pod_manifest, wait_for

pytestmark = pytest.mark.k8s


def container(name: str, script: str, **extra) -> dict:
    return {"name": name, "image": "ignored", "command": ["sh", "-c", script], **extra}


def logs(cluster, ns: str, pod: str, container: str) -> str:
    return cluster.kubectl("logs", pod, "-n", ns, "-c", container).stdout


def finished(pod) -> bool:
    return pod.status.phase in ("Succeeded", "Failed")


def test_a_failed_init_container_fails_a_never_restarting_pod_with_its_termination_message(k8s_cluster, k8s_namespace):
    ns = k8s_namespace
    fetch = container("fetch-model", "echo fetching tinny; echo 'repository tinny not found' > /dev/termination-log; "
                                     "exit 2")
    pod = pod_manifest("fetch-fails", ["sh", "-c", "echo should not run"], restartPolicy="Never",
                       initContainers=[fetch])
    crash = pod_manifest("crash", ["sh", "-c", "echo 'Traceback: boom'; exit 1"], restartPolicy="Never",
                         container={"terminationMessagePolicy": "FallbackToLogsOnError"})
    k8s_cluster.apply([pod, crash], ns)
    pod = k8s_cluster.wait_for_pod(ns, "fetch-fails", finished, timeout=30, what="the pod to finish")
    assert pod.status.phase == "Failed"
    init = pod.status.init_container_statuses[0].state.terminated
    assert (init.exit_code, init.reason, init.message) == (2, "Error", "repository tinny not found\n")
    assert pod.status.container_statuses[0].state.waiting.reason == "PodInitializing"  # never started
    assert logs(k8s_cluster, ns, "fetch-fails", "fetch-model") == "fetching tinny\n"
    crash = k8s_cluster.wait_for_pod(ns, "crash", finished, timeout=30, what="the crash")
    assert crash.status.container_statuses[0].state.terminated.message == "Traceback: boom\n"


def test_a_failing_init_container_is_retried_before_the_containers_start(k8s_cluster, k8s_namespace):
    ns = k8s_namespace
    mounts = [{"name": "scratch", "mountPath": "/scratch"}]
    flaky = container("fetch-model", "if [ -e /scratch/tried ]; then echo fetched > /scratch/model; exit 0; fi; "
                                     "touch /scratch/tried; echo 'connection reset' > /dev/termination-log; exit 1",
                      volumeMounts=mounts)
    second = container("check", "cat /scratch/model", volumeMounts=mounts)
    pod = pod_manifest("retry", ["sh", "-c", "cat /scratch/model; exec sleep 3600"], restartPolicy="OnFailure",
                       initContainers=[flaky, second], volumes=[{"name": "scratch", "emptyDir": {}}],
                       container={"volumeMounts": mounts})
    k8s_cluster.apply(pod, ns)
    pod = k8s_cluster.wait_for_pod(ns, "retry", timeout=30)
    fetch, check = pod.status.init_container_statuses
    assert fetch.restart_count == 1 and fetch.state.terminated.exit_code == 0
    assert fetch.last_state.terminated.message == "connection reset\n"
    assert check.state.terminated.reason == "Completed"
    assert logs(k8s_cluster, ns, "retry", "check") == "fetched\n"


SIDECAR = "python3 -m http.server --bind $(POD_IP) 9000"
CLIENT = ("python3 -c \"import os, urllib.request; "
          "print(urllib.request.urlopen('http://' + os.environ['POD_IP'] + ':9000/', timeout=5).status)\"")


def condition(pod, type_: str) -> str:
    return next(c.status for c in pod.status.conditions or [] if c.type == type_)


def test_a_sidecar_starts_before_the_containers_and_stops_after_they_finish(k8s_cluster, k8s_namespace):
    ns = k8s_namespace
    pod_ip = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    # Started only once the test says so: until then the pod must not go past it.
    startup = {"exec": {"command": ["test", "-f", "/flags/go"]}, "periodSeconds": 1, "failureThreshold": 60}
    sidecar = container("proxy", SIDECAR, restartPolicy="Always", env=pod_ip, startupProbe=startup,
                        volumeMounts=[{"name": "flags", "mountPath": "/flags"}])
    k8s_cluster.apply(pod_manifest("with-sidecar", ["sh", "-c", CLIENT], restartPolicy="Never",
                                   initContainers=[sidecar], volumes=[{"name": "flags", "emptyDir": {}}]), ns)
    pod = k8s_cluster.wait_for_pod(ns, "with-sidecar", lambda p: p.status.init_container_statuses
                                   and p.status.init_container_statuses[0].state.running, what="the sidecar to run")
    assert not pod.status.init_container_statuses[0].started
    assert (pod.status.phase, condition(pod, "Initialized")) == ("Pending", "False")
    assert pod.status.container_statuses[0].state.waiting.reason == "PodInitializing"

    flags = k8s_cluster.plane.agent_dir / "pods" / f"{ns}_with-sidecar_{pod.metadata.uid}" / "volumes" / "flags"
    (flags / "go").touch()
    pod = k8s_cluster.wait_for_pod(ns, "with-sidecar", finished, timeout=30, what="the pod to finish")
    assert pod.status.phase == "Succeeded"  # the sidecar's own exit does not count
    assert condition(pod, "Initialized") == "True"
    assert logs(k8s_cluster, ns, "with-sidecar", "main").strip() == "200"  # it was serving first
    proxy = pod.status.init_container_statuses[0]
    assert proxy.state.terminated is not None and proxy.restart_count == 0


DRAIN = """
import os, signal, sys, time
out = open("/out/order", "a", buffering=1)
def drain(*_):
    out.write("sigterm prestop-done=%s\\n" % os.path.exists("/out/prestop"))
    time.sleep(0.5)  # finish in-flight work
    out.write("exit 0\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
print("serving", flush=True)
while True:
    time.sleep(1)
"""


def test_deletion_runs_pre_stop_then_sigterm_and_a_clean_exit_ends_the_pod_succeeded(
        k8s_cluster, k8s_namespace, tmp_path):
    ns = k8s_namespace
    pre_stop = {"exec": {"command": ["sh", "-c", "echo prestop >> /out/order; touch /out/prestop"]}}
    pod = pod_manifest("server", ["python3", "-c", DRAIN], terminationGracePeriodSeconds=20,
                       volumes=[{"name": "out", "hostPath": {"path": str(tmp_path)}}],
                       container={"lifecycle": {"preStop": pre_stop},
                                  "volumeMounts": [{"name": "out", "mountPath": "/out"}]})
    k8s_cluster.apply(pod, ns)
    uid = k8s_cluster.wait_for_pod(ns, "server").metadata.uid
    # Ready (no probe) is the process started, not the program: on loaded cores a deletion could come
    # before python had its handler, or the file open, and no order could be recorded at all
    wait_for(lambda: "serving" in logs(k8s_cluster, ns, "server", "main"), timeout=30, what="the server serving")
    phases = watch_phases(k8s_cluster, ns, "server")
    k8s_cluster.core.delete_namespaced_pod("server", ns)
    k8s_cluster.wait_for_pod_gone(ns, "server", timeout=15)
    wait_for(lambda: phases.done, timeout=5, what="the watch to see the deletion")
    assert (tmp_path / "order").read_text().splitlines() == ["prestop", "sigterm prestop-done=True", "exit 0"]
    assert phases.final == ("Succeeded", 0), f"last status before deletion: {phases.final} (uid {uid})"


class watch_phases:
    """Watches one pod and remembers its phase and exit code in the last status before it is gone."""

    def __init__(self, cluster, ns: str, name: str):
        from kubernetes import watch
        self.final, self.done = None, False
        self._watch = watch.Watch()
        stream = self._watch.stream(cluster.core.list_namespaced_pod, ns, field_selector=f"metadata.name={name}",
                                    timeout_seconds=60)
        ready = threading.Event()

        def run():
            for event in stream:
                ready.set()
                pod = event["object"]
                statuses = pod.status.container_statuses or []
                terminated = statuses[0].state.terminated if statuses else None
                if event["type"] == "DELETED":
                    self.done = True
                    self._watch.stop()
                    return
                self.final = (pod.status.phase, terminated.exit_code if terminated else None)

        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)  # the initial ADDED event: the watch is open
