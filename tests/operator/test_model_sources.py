"""Model sources in the operator: the pods a source asks for (an init container fetching into the
cache, the claim mounted read-only, credentials), what a server pod's statuses say about its
model, and what the fleet's status says (status.model, Progressing ModelDownloading, Degraded
ModelUnavailable with the real cause). Pure, except the reconcile passes against a fake API."""

import asyncio
import json
import logging
from pathlib import Path

import pytest

from adpfleet.model_uri import (ModelSourceError, fetched_message, progress_line, progress_start_line,
                                termination_message)
from adpfleet.operator.adapters.kube import ApiResult
from adpfleet.operator.decisions import conditions
from adpfleet.operator.decisions.desired import desired_fleet, server_template
from adpfleet.operator.decisions.model_status import model_report
from adpfleet.operator.decisions.observed import FETCHED, FETCHING, UNAVAILABLE, FleetObservation, server_pod
from adpfleet.operator.reconciler import FleetMemory, Reconciler
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetRef
from adpfleet.operator.telemetry import OperatorMetrics

from specs import fleet_manifest

FLEET = FleetRef("demo", "ns1", "uid-1")
log = logging.getLogger("test")


def spec(model: dict, **overrides) -> FleetSpec:
    return FleetSpec.model_validate(fleet_manifest(model=model, **overrides)["spec"])


def pod_spec(model: dict, role: str = "context", **overrides) -> dict:
    return server_template(FLEET, spec(model, **overrides), role).pod(0)["spec"]


def mounts(container: dict) -> dict:
    return {m["mountPath"]: m for m in container["volumeMounts"]}


def env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


# ---- the pods a source asks for ------------------------------------------------------------------

def test_an_hf_source_is_fetched_by_an_init_container_into_the_cache_the_server_reads():
    pod = pod_spec({"uri": "hf://acme/tiny-llama@v1", "endpoint": "http://hub.local:8080",
                    "tokenSecretRef": {"name": "hf", "key": "token"}, "cache": {"sizeLimit": "20Gi"}})
    (fetch,) = pod["initContainers"]
    server = pod["containers"][0]
    assert fetch["name"] == "fetch-model" and fetch["command"] == ["adpfleet"]
    assert fetch["args"] == ["fetch-model", "hf://acme/tiny-llama@v1", "--cache-dir", "/var/cache/adpfleet/models",
                            "--engine", "adpfleet"]
    assert fetch["image"] == server["image"]  # the same image
    args = server["args"]
    assert args[args.index("--model") + 1:args.index("--model") + 4] == [
        "hf://acme/tiny-llama@v1", "--cache-dir", "/var/cache/adpfleet/models"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", "emptyDir": {"sizeLimit": "20Gi"}}
    assert "readOnly" not in mounts(fetch)["/var/cache/adpfleet/models"]  # the download writes it
    assert mounts(server)["/var/cache/adpfleet/models"]["readOnly"] is True
    # credentials and the endpoint reach the download only
    assert env(fetch)["HF_ENDPOINT"] == "http://hub.local:8080"
    assert env(fetch)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert "HF_TOKEN" not in env(server) and "HF_ENDPOINT" not in env(server)
    # the kubelet enforces the emptyDir's size by eviction: the download checks it before the weights
    assert env(fetch)["ADPFLEET_CACHE_SIZE_LIMIT"] == str(20 * 2**30)
    # why a model cannot be had is where Kubernetes shows it
    for c in (fetch, server):
        assert (c["terminationMessagePath"], c["terminationMessagePolicy"]) == ("/dev/termination-log",
                                                                               "FallbackToLogsOnError")
        assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_an_s3_source_gets_its_credentials_secret_and_endpoint_and_a_shared_cache_claim():
    pod = pod_spec({"uri": "s3://models/llama/8b", "endpoint": "http://minio.minio:9000",
                    "credentialsSecretRef": {"name": "s3-creds"}, "cache": {"claimName": "model-cache"}})
    fetch = pod["initContainers"][0]
    e = env(fetch)
    assert e["AWS_ENDPOINT_URL"] == "http://minio.minio:9000" and "HF_ENDPOINT" not in e
    assert e["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}}
    assert e["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert e["AWS_REGION"] == {"secretKeyRef": {"name": "s3-creds", "key": "AWS_REGION", "optional": True}}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}}
    assert "ADPFLEET_CACHE_SIZE_LIMIT" not in e  # a claim's size is the file system's own


def test_a_pvc_source_is_mounted_read_only_where_the_runtime_looks_and_checked_first():
    pod = pod_spec({"uri": "pvc://model-store/llama/8b"})
    fetch, server = pod["initContainers"][0], pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-source"] == {"name": "model-source",
                                       "persistentVolumeClaim": {"claimName": "model-store", "readOnly": True}}
    assert "model-cache" not in volumes  # nothing is downloaded
    for c in (fetch, server):
        assert mounts(c)["/mnt/adpfleet/pvc/model-store"] == {"name": "model-source",
                                                              "mountPath": "/mnt/adpfleet/pvc/model-store",
                                                              "readOnly": True}
    # checks it the way loading would
    assert fetch["args"] == ["fetch-model", "pvc://model-store/llama/8b", "--engine", "adpfleet"]


def test_an_in_image_directory_is_checked_and_a_built_in_model_needs_no_init_container():
    directory = pod_spec({"uri": "/models/llama"})
    assert directory["initContainers"][0]["args"] == ["fetch-model", "/models/llama", "--engine", "adpfleet"]
    assert {v["name"] for v in directory["volumes"]} == {"scratch", "shm"}
    builtin = pod_spec({"name": "tiny"})
    assert "initContainers" not in builtin and {v["name"] for v in builtin["volumes"]} == {"scratch", "shm"}
    args = builtin["containers"][0]["args"]
    assert args[args.index("--model") + 1:args.index("--model") + 3] == ["tiny", "--dp"]


def test_the_download_gets_the_roles_env_and_cpu_memory_but_never_gpus():
    role = {"servers": 1, "adpRanks": 2, "gpusPerServer": 2, "engine": {"device": "cuda"},
            "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
            "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}}
    pod = pod_spec({"uri": "hf://acme/tiny"}, role="generation", generation=role)
    fetch = pod["initContainers"][0]
    assert env(fetch)["HTTPS_PROXY"] == "http://proxy:3128"
    assert fetch["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"


def test_a_change_of_the_model_source_rolls_both_roles():
    base = desired_fleet(FLEET, spec({"uri": "hf://acme/tiny@v1"}))
    for model in ({"uri": "hf://acme/tiny@v2"}, {"uri": "hf://acme/tiny@v1", "cache": {"sizeLimit": "1Gi"}},
                  {"uri": "hf://acme/tiny@v1", "endpoint": "http://mirror:80"}, {"uri": "pvc://store/tiny"}):
        other = desired_fleet(FLEET, spec(model))
        for role in ("context", "generation"):
            assert other.servers[role].template_hash != base.servers[role].template_hash, model
    # name is the older spelling of uri: the same pods
    assert desired_fleet(FLEET, spec({"name": "hf://acme/tiny@v1"})) == base


# ---- what a server pod's statuses say about its model ----------------------------------------------

def failure(reason: str, message: str, uri: str = "hf://acme/missing") -> dict:
    """A container's termination as `adpfleet fetch-model` leaves it."""
    error = ModelSourceError(reason, message, uri)
    return {"terminated": {"exitCode": error.exit_code, "reason": "Error", "message": termination_message(error)}}


def pod_body(init_state=None, init_last=None, server_state=None, server_last=None, ready=False) -> dict:
    status = {"phase": "Pending", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if init_state is not None:
        status["initContainerStatuses"] = [{"name": "fetch-model", "state": init_state,
                                            "lastState": init_last or {}, "restartCount": 1 if init_last else 0}]
    status["containerStatuses"] = [{"name": "server", "ready": ready,
                                    "state": server_state or {"waiting": {"reason": "PodInitializing"}},
                                    "lastState": server_last or {}}]
    return {"metadata": {"name": "demo-context-0", "uid": "u1", "labels": {"adpfleet.io/role": "context",
                                                                           "adpfleet.io/index": "0"}},
            "status": status}


def test_a_running_download_is_fetching_and_a_finished_one_fetched():
    assert server_pod(pod_body({"running": {}})).model == FETCHING
    assert server_pod(pod_body({"waiting": {"reason": "PodInitializing"}})).model == ""  # not started yet
    done = server_pod(pod_body({"terminated": {"exitCode": 0}}, server_state={"running": {}}))
    assert (done.model, done.model_failure, done.problem) == (FETCHED, None, None)
    assert server_pod(pod_body(server_state={"running": {}}, ready=True)).model == ""  # built-in: no init container


def test_the_revision_a_finished_download_reports_is_the_fleets_model_revision():
    def fetched(revision, name):
        message = fetched_message("hf://acme/tiny@main", revision)
        return server_pod({**pod_body({"terminated": {"exitCode": 0, "message": message}},
                                      server_state={"running": {}}), "metadata": {"name": name, "uid": name}})
    a, b = fetched("c0ffee", "demo-context-0"), fetched("c0ffee", "demo-generation-0")
    assert (a.model, a.model_revision) == (FETCHED, "c0ffee")
    assert model_report(parsed("hf://acme/tiny@main"), [a, b], {}).status == {
        "source": "hf://acme/tiny@main", "phase": "Available", "revision": "c0ffee"}
    # servers with their own caches that fetched while the branch moved: both commits, said so
    moved = model_report(parsed("hf://acme/tiny@main"), [a, fetched("beef", "demo-generation-1")], {})
    assert moved.status["revision"] == "beef, c0ffee"
    # a running or failed fetch reports none, nor does a message that is not a fetch's
    assert server_pod(pod_body({"running": {}})).model_revision == ""
    assert server_pod(pod_body({"terminated": {"exitCode": 0, "message": "done"}})).model_revision == ""
    assert "revision" not in model_report(parsed("pvc://store/tiny"), [server_pod(pod_body(
        {"terminated": {"exitCode": 0}}, server_state={"running": {}}))], {}).status


def test_a_failed_download_is_unavailable_with_the_cause_from_its_termination_message():
    pod = server_pod(pod_body(failure("RepositoryNotFound", "repository acme/missing not found")))
    assert pod.model == UNAVAILABLE and pod.waiting_for_model
    assert pod.model_failure == ("RepositoryNotFound", "repository acme/missing not found")
    assert pod.problem is None  # reported as the fleet's model, not as a crashing server


def test_a_download_in_back_off_stays_unavailable_and_is_not_called_a_crash_loop():
    backing_off = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}}
    pod = server_pod(pod_body(backing_off, init_last=failure("Unauthorized", "acme/gated is gated")))
    assert pod.model_failure == ("Unauthorized", "acme/gated is gated") and pod.problem is None
    retrying = server_pod(pod_body({"running": {}}, init_last=failure("Unauthorized", "acme/gated is gated")))
    assert retrying.model == UNAVAILABLE  # until it succeeds: the fleet does not flap
    fixed = server_pod(pod_body({"terminated": {"exitCode": 0}}, init_last=failure("Unauthorized", "gated"),
                                server_state={"running": {}}))
    assert (fixed.model, fixed.model_failure) == (FETCHED, None)


def test_a_server_that_cannot_load_its_model_is_unavailable_until_it_turns_ready():
    last = failure("UnsupportedModelType", "config.json names model_type 'gpt2'")
    pod = server_pod(pod_body({"terminated": {"exitCode": 0}}, server_state={"waiting": {"reason": "CrashLoopBackOff"}},
                              server_last=last))
    assert pod.model_failure[0] == "UnsupportedModelType" and pod.problem is None
    ready = server_pod(pod_body({"terminated": {"exitCode": 0}}, server_state={"running": {}}, server_last=last,
                                ready=True))
    assert ready.model_failure is None and not ready.waiting_for_model


def test_without_a_termination_message_the_exit_code_still_names_the_reason():
    pod = server_pod(pod_body({"terminated": {"exitCode": 21, "message": "Traceback ...\nOSError: [Errno 28]"}}))
    assert pod.model_failure[0] == "DiskFull"


def test_a_crash_that_is_not_about_the_model_is_a_crash_loop_as_before():
    crash = {"terminated": {"exitCode": 1, "message": "Traceback (most recent call last): ..."}}
    pod = server_pod(pod_body({"terminated": {"exitCode": 0}}, server_state={
        "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}}, server_last=crash))
    assert pod.model_failure is None
    assert pod.problem == "CrashLoopBackOff: container server exited with code 1: Traceback (most recent call last): ..."
    init_crash = server_pod(pod_body({"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
                                     init_last=crash))
    assert init_crash.problem.startswith("CrashLoopBackOff: container fetch-model exited with code 1")  # init too


# ---- the fleet's status ------------------------------------------------------------------------------

def parsed(uri: str):
    return spec({"uri": uri}).model.parsed


def test_downloads_are_summed_and_named_server_by_server():
    pods = [server_pod({**pod_body({"running": {}}), "metadata": {"name": name, "uid": name}})
            for name in ("demo-context-0", "demo-generation-0", "demo-generation-1")]
    report = model_report(parsed("hf://acme/tiny"), pods, {"demo-context-0": (52_400_000, 104_900_000),
                                                           "demo-generation-0": (10_000_000, 104_900_000)})
    assert report.status == {"source": "hf://acme/tiny", "phase": "Downloading", "bytesDone": 62_400_000,
                             "bytesTotal": 209_800_000, "progress": "62.4 MB of 209.8 MB (30%)"}
    assert report.downloading == ("downloading hf://acme/tiny: demo-context-0 52.4 MB of 104.9 MB (50%), "
                                  "demo-generation-0 10.0 MB of 104.9 MB (10%), demo-generation-1 starting")
    assert report.problems == []


def test_one_unavailable_problem_per_cause_naming_its_servers():
    a = server_pod(pod_body(failure("RevisionNotFound", "acme/tiny has no revision 'v9'")))
    b = server_pod({**pod_body(failure("RevisionNotFound", "acme/tiny has no revision 'v9'")),
                    "metadata": {"name": "demo-generation-0", "uid": "u2"}})
    report = model_report(parsed("hf://acme/tiny@v9"), [a, b], {})
    assert report.status == {"source": "hf://acme/tiny@v9", "phase": "Unavailable", "reason": "RevisionNotFound"}
    assert [(p.reason, p.message) for p in report.problems] == [
        ("ModelUnavailable", "RevisionNotFound: acme/tiny has no revision 'v9' (demo-context-0, demo-generation-0)")]
    assert report.downloading is None


def test_phases_pending_available_and_a_missing_claim():
    uri = parsed("pvc://store/tiny")
    assert model_report(uri, [], {}).status["phase"] == "Pending"
    fetched = server_pod(pod_body({"terminated": {"exitCode": 0}}, server_state={"running": {}}))
    assert model_report(uri, [fetched], {}).status["phase"] == "Available"
    assert model_report(uri, [], {}, claim_missing=True).status == {"source": "pvc://store/tiny",
                                                                   "phase": "Unavailable", "reason": "ClaimNotFound"}
    checking = server_pod(pod_body({"running": {}}))  # a pvc:// check is quick and downloads nothing
    assert model_report(uri, [checking], {}).status["phase"] == "Pending"


def test_progress_lines_are_read_back_from_the_log_as_written():
    log = "\n".join(["2026-01-01 INFO adpfleet.fetch: " + progress_start_line("hf://a/b@c0ffee", 104_857_600, 0),
                     "2026-01-01 INFO adpfleet.fetch: " + progress_line("hf://a/b@c0ffee", 52_428_800, 104_857_600, 3e7)])
    from adpfleet.model_uri import parse_progress
    assert parse_progress(log) == (52_400_000, 104_900_000)
    assert parse_progress(log.splitlines()[0]) == (0, 104_900_000)
    assert parse_progress("Fetching 3 files") is None


# ---- one reconcile pass ------------------------------------------------------------------------------

class FakeApi:
    def __init__(self, logs=None, claims=()):
        self.calls, self.events, self.logs = [], [], logs or {}
        self.claims, self.created_secrets = set(claims), []
        self.last_status = None

    async def create_pod(self, manifest):
        self.calls.append(("create_pod", manifest["metadata"]["name"]))
        return ApiResult(True)

    async def apply(self, manifest):
        return ApiResult(True)

    async def patch_fleet_status(self, namespace, name, status):
        self.last_status = status
        return ApiResult(True)

    async def record_event(self, fleet, type_, reason, message):
        self.events.append((type_, reason, message))
        return ApiResult(True)

    async def create_secret(self, manifest):  # the fleet's internal token; no Secret is ever read
        self.created_secrets.append(manifest["metadata"]["name"])
        return ApiResult(True)

    async def claim_exists(self, namespace, name):
        self.calls.append(("get_claim", name))
        return ApiResult(True, 200 if name in self.claims else 404)

    async def container_log(self, namespace, pod, container, tail_lines):
        self.calls.append(("log", pod, container))
        return self.logs.get(pod)

    async def create_role_object(self, manifest):  # each role's InferenceFleetRole (scale target)
        return ApiResult(True)

    async def patch_role_object(self, namespace, name, body):
        return ApiResult(True)

    async def patch_role_status(self, namespace, name, status):
        return ApiResult(True)


def observation(model: dict, bodies=(), status=None) -> FleetObservation:
    m = fleet_manifest("f", router={"enabled": False}, model=model)
    s = FleetSpec.model_validate(m["spec"])
    desired = desired_fleet(FleetRef("f", "ns", "fleet-uid"), s)
    pods = []
    for role, body in bodies:
        body = json.loads(json.dumps(body))
        body["metadata"].update(name=f"f-{role}-0", uid=f"u-{role}", ownerReferences=[
            {"uid": "fleet-uid", "controller": True}], annotations={
            "adpfleet.io/template-hash": desired.servers[role].template_hash})
        body["metadata"]["labels"] = {"adpfleet.io/role": role, "adpfleet.io/index": "0"}
        pods.append(server_pod(body))
    return FleetObservation(name="f", namespace="ns", uid="fleet-uid", generation=1, resource_version="1",
                            spec=m["spec"], status=status or {}, pods=tuple(pods), objects=())


def reconcile(api, obs):
    return asyncio.run(Reconciler(api, OperatorMetrics()).reconcile(obs, FleetMemory(), log))


def condition(status, type_):
    return next(c for c in status["conditions"] if c["type"] == type_)


def test_a_pass_reads_the_progress_of_running_downloads_and_looks_again_soon():
    line = "INFO adpfleet.fetch: " + progress_line("hf://acme/tiny@abc", 30_000_000, 120_000_000, 1e7)
    api = FakeApi(logs={"f-context-0": line})
    result = reconcile(api, observation({"uri": "hf://acme/tiny"}, [("context", pod_body({"running": {}})),
                                                                    ("generation", pod_body({"running": {}}))]))
    assert ("log", "f-context-0", "fetch-model") in api.calls and ("log", "f-generation-0", "fetch-model") in api.calls
    progressing = condition(api.last_status, "Progressing")
    assert progressing["reason"] == "ModelDownloading"
    assert progressing["message"].startswith("downloading hf://acme/tiny: f-context-0 30.0 MB of 120.0 MB (25%), "
                                              "f-generation-0 starting")
    assert api.last_status["model"]["phase"] == "Downloading" and api.last_status["model"]["bytesDone"] == 30_000_000
    assert result.requeue_after <= 5


def test_a_pass_over_servers_that_cannot_have_their_model_is_degraded_with_the_cause_and_an_event():
    broken = pod_body(failure("Unauthorized", "acme/gated is gated: it cannot be downloaded without a token"))
    api = FakeApi()
    reconcile(api, observation({"uri": "hf://acme/gated"}, [("context", broken), ("generation", broken)]))
    degraded = condition(api.last_status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ModelUnavailable")
    assert degraded["message"] == ("Unauthorized: acme/gated is gated: it cannot be downloaded without a token "
                                   "(f-context-0, f-generation-0)")
    assert ("Warning", "ModelUnavailable", degraded["message"]) in api.events
    assert api.last_status["model"] == {"source": "hf://acme/gated", "phase": "Unavailable", "reason": "Unauthorized"}
    assert not [c for c in api.calls if c[0] == "log"]  # nothing is downloading


def test_a_store_that_names_a_file_outside_the_model_is_degraded_naming_the_file():
    """The refusal as the fetch writes it (checkpoint.model_file), read back from the pod."""
    from adpfleet.runtime.model.checkpoint import model_file

    with pytest.raises(ModelSourceError) as refused:
        model_file(Path("/var/cache/adpfleet/models/s3--models--evil.partial"), "../../escape/evil.safetensors",
                   "s3://models/evil: model.safetensors.index.json")
    broken = pod_body(failure(refused.value.reason, refused.value.message, "s3://models/evil"))
    api = FakeApi()
    reconcile(api, observation({"uri": "s3://models/evil"}, [("context", broken), ("generation", broken)]))
    degraded = condition(api.last_status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ModelUnavailable")
    assert degraded["message"] == ("UnsafeFileName: s3://models/evil: model.safetensors.index.json names "
                                   "'../../escape/evil.safetensors', which escapes the model directory (a '..' "
                                   "segment) (f-context-0, f-generation-0)")
    assert api.last_status["model"]["reason"] == "UnsafeFileName"


def test_no_server_is_created_while_a_claim_the_model_needs_is_missing():
    api = FakeApi()
    result = reconcile(api, observation({"uri": "pvc://model-store/tiny"}))
    assert not [c for c in api.calls if c[0] == "create_pod"] and ("get_claim", "model-store") in api.calls
    degraded = condition(api.last_status, "Degraded")
    assert degraded["reason"] == "ModelUnavailable" and "PersistentVolumeClaim 'model-store'" in degraded["message"]
    assert "waiting for PersistentVolumeClaim model-store" in condition(api.last_status, "Progressing")["message"]
    assert api.last_status["model"]["reason"] == "ClaimNotFound" and result.requeue_after == 30

    cache = FakeApi(claims={"model-store"})
    reconcile(cache, observation({"uri": "hf://acme/tiny", "cache": {"claimName": "shared-cache"}}))
    assert ("get_claim", "shared-cache") in cache.calls and "spec.model.cache.claimName" in \
        condition(cache.last_status, "Degraded")["message"]

    present = FakeApi(claims={"model-store"})
    reconcile(present, observation({"uri": "pvc://model-store/tiny"}))
    assert [c for c in present.calls if c[0] == "create_pod"] == [("create_pod", "f-context-0"),
                                                                 ("create_pod", "f-generation-0")]


def test_model_credentials_are_not_read_and_a_missing_one_is_degraded_naming_its_field():
    # The operator reads no Secret (docs/security.md): the servers are created, and the kubelet resolves
    # the credentials for the fetch-model init container; one it cannot find keeps that container waiting.
    model = {"uri": "s3://models/tiny", "credentialsSecretRef": {"name": "s3"}}
    api = FakeApi()
    reconcile(api, observation(model))
    assert [c for c in api.calls if c[0] == "create_pod"] == [("create_pod", "f-context-0"),
                                                             ("create_pod", "f-generation-0")]
    assert not [c for c in api.calls if "secret" in c[0]]
    stuck = pod_body({"waiting": {"reason": "CreateContainerConfigError",
                                  "message": "couldn't find key AWS_SECRET_ACCESS_KEY in Secret ns/s3"}})
    api = FakeApi()
    reconcile(api, observation(model, [("context", stuck), ("generation", stuck)]))
    degraded = condition(api.last_status, "Degraded")
    assert degraded["reason"] == "SecretNotFound" and "AWS_SECRET_ACCESS_KEY" in degraded["message"]
    assert "(spec.model.credentialsSecretRef)" in degraded["message"]
    token = pod_body({"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}})
    api = FakeApi()
    reconcile(api, observation({"uri": "hf://acme/gated", "tokenSecretRef": {"name": "hf", "key": "token"}},
                               [("context", token)]))
    assert "(spec.model.tokenSecretRef)" in condition(api.last_status, "Degraded")["message"]


def test_a_built_in_model_makes_no_extra_request_and_is_available_once_a_server_is_ready():
    ready = pod_body(server_state={"running": {}}, ready=True)
    ready["status"]["phase"] = "Running"
    api = FakeApi()
    reconcile(api, observation({"name": "tiny"}, [("context", ready), ("generation", ready)]))
    assert api.calls == [] and api.last_status["model"] == {"source": "tiny", "phase": "Available"}
    assert condition(api.last_status, "Progressing")["reason"] == "Complete"


def test_a_download_is_named_first_in_progressing_even_during_a_roll():
    obs = observation({"uri": "hf://acme/tiny"})
    status = conditions.fleet_status(obs, {"context": {"desired": 1, "current": 1, "updated": 0, "ready": 0}}, None,
                                     [], None, [], "2026-01-01T00:00:00Z", downloading="downloading hf://acme/tiny: x")
    assert condition(status, "Progressing")["reason"] == "ModelDownloading"


def test_the_status_patch_removes_what_a_nested_object_no_longer_has():
    from adpfleet.operator.reconciler import merge_patch

    before = {"model": {"source": "hf://a/b", "phase": "Downloading", "bytesDone": 1, "bytesTotal": 2},
              "readyRoles": "0/2", "gone": {"x": 1}}
    after = {"model": {"source": "hf://a/b", "phase": "Available"}, "readyRoles": "2/2"}
    assert merge_patch(before, after) == {"model": {"source": "hf://a/b", "phase": "Available", "bytesDone": None,
                                                    "bytesTotal": None}, "readyRoles": "2/2", "gone": None}


def test_a_pass_reads_no_log_when_the_source_downloads_nothing():
    api = FakeApi(claims={"store"})
    reconcile(api, observation({"uri": "pvc://store/tiny"}, [("context", pod_body({"running": {}})),
                                                             ("generation", pod_body({"running": {}}))]))
    assert not [c for c in api.calls if c[0] == "log"] and api.last_status["model"]["phase"] == "Pending"
