"""A container's environment and command line are built the way the kubelet builds them."""

import asyncio
import dataclasses

import pytest

from adpfleet.cluster.agent import podenv

NODE = podenv.NodeContext(host_ip="127.0.0.1", apiserver_host="127.0.0.1", apiserver_port=6443,
                          allocatable={"cpu": "2", "memory": "4Gi"})
POD = {"metadata": {"name": "web-0", "namespace": "fleet", "uid": "u-1", "labels": {"app": "web"}},
       "spec": {"nodeName": "adpfleet-node", "serviceAccountName": "router", "containers": []}}


def build(container: dict, objects: dict | None = None, node: podenv.NodeContext = NODE, tmpdir: str = "") -> dict:
    async def fetch(kind, name):
        return (objects or {}).get((kind, name))
    return asyncio.run(podenv.container_env(POD, container, "127.0.1.7", node, fetch, {}, tmpdir))


def test_dollar_paren_expands_known_variables_and_keeps_unknown_ones():
    env = {"PORT": "8080"}
    assert podenv.expand("--port=$(PORT)", env) == "--port=8080"
    assert podenv.expand("$(MISSING)", env) == "$(MISSING)"
    assert podenv.expand("$$(PORT) costs $$5", env) == "$(PORT) costs $5"
    assert podenv.expand("unterminated $(PORT", env) == "unterminated $(PORT"


def test_downward_api_field_refs_resolve_to_the_pods_values():
    refs = {"IP": "status.podIP", "NAME": "metadata.name", "NS": "metadata.namespace",
            "APP": "metadata.labels['app']", "NODE": "spec.nodeName", "SA": "spec.serviceAccountName"}
    env = build({"name": "c", "env": [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}}
                                      for k, v in refs.items()]})
    assert {k: env[k] for k in refs} == {"IP": "127.0.1.7", "NAME": "web-0", "NS": "fleet", "APP": "web",
                                         "NODE": "adpfleet-node", "SA": "router"}


def test_env_values_expand_earlier_variables_and_command_expands_the_result():
    container = {"name": "c", "command": ["serve"], "args": ["--host=$(HOST)", "--url=$(URL)"],
                 "env": [{"name": "HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                         {"name": "URL", "value": "http://$(HOST):8000"}]}
    env = build(container)
    assert podenv.command_line(container, env) == ["serve", "--host=127.0.1.7", "--url=http://127.0.1.7:8000"]


def test_path_starts_with_this_pythons_bin_and_the_apiserver_is_on_loopback():
    import sys
    env = build({"name": "c"})
    assert env["PATH"].split(":")[0] == f"{sys.prefix}/bin"
    assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == ("127.0.0.1", "6443")


def test_pods_get_the_images_environment_with_this_machines_kernels_and_their_own_env_wins(monkeypatch, tmp_path):
    # The runtime image sets ADPFLEET_KERNEL_DIR; a pod's HOME is its scratch volume, so without it
    # every server here would compile the kernels in its first decode and look hung meanwhile.
    monkeypatch.setenv("ADPFLEET_KERNEL_DIR", str(tmp_path))
    env = build({"name": "c", "env": [{"name": "OMP_NUM_THREADS", "value": "4"}]})
    assert env["ADPFLEET_KERNEL_DIR"] == str(tmp_path)
    assert env["OMP_NUM_THREADS"] == "4"
    monkeypatch.delenv("ADPFLEET_KERNEL_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert build({"name": "c"})["ADPFLEET_KERNEL_DIR"] == str(tmp_path / ".cache" / "adpfleet" / "kernels")


def test_config_map_and_secret_references_are_read_and_missing_ones_are_config_errors():
    objects = {("ConfigMap", "cfg"): {"data": {"mode": "fast", "bad key": "x"}},
               ("Secret", "s"): {"data": {"token": "c2VjcmV0"}}}
    env = build({"name": "c", "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
                 "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}}]},
                objects)
    assert env["CFG_mode"] == "fast" and env["TOKEN"] == "secret" and "CFG_bad key" not in env
    with pytest.raises(podenv.ContainerConfigError, match='configmap "nope" not found'):
        build({"name": "c", "envFrom": [{"configMapRef": {"name": "nope"}}]})


def test_a_container_without_command_cannot_run_because_images_are_ignored():
    with pytest.raises(podenv.ContainerConfigError, match="ignores images"):
        podenv.command_line({"name": "c", "image": "nginx"}, {})


def test_vllm_runs_from_the_vllm_environment_whose_bin_follows_this_pythons_on_the_path():
    import sys
    env = build({"name": "c", "command": ["vllm", "serve"]}, node=dataclasses.replace(NODE, vllm_bin="/vllm-env/bin"))
    assert env["PATH"].split(":")[:2] == [f"{sys.prefix}/bin", "/vllm-env/bin"]
    assert build({"name": "c"})["PATH"].split(":")[1] == "/usr/local/sbin"  # no vLLM environment: nothing added


def test_a_vllm_container_on_a_node_without_the_vllm_environment_is_refused_with_how_to_build_it():
    node = dataclasses.replace(NODE, vllm_missing="not built; build it with `scripts/setup --with-vllm`")
    with pytest.raises(podenv.ContainerConfigError, match=r"runs `vllm`.*scripts/setup --with-vllm"):
        build({"name": "c", "command": ["vllm", "serve", "/models/m"]}, node=node)
    assert build({"name": "c", "command": ["adpfleet", "serve"]}, node=node)  # other containers do not need it


def test_each_container_gets_its_own_tmpdir_and_the_pods_env_wins():
    assert build({"name": "c"}, tmpdir="/pods/p/tmp/c")["TMPDIR"] == "/pods/p/tmp/c"
    mine = {"name": "c", "env": [{"name": "TMPDIR", "value": "/scratch"}]}
    assert build(mine, tmpdir="/pods/p/tmp/c")["TMPDIR"] == "/scratch"
