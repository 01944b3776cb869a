"""The cluster names a pod resolves: what CoreDNS would answer for headless Services, written as
the pod's /etc/hosts with the short names its search path would expand."""

from adpfleet.cluster.agent.hosts import hosts_file, names_seen_from, rewrite_in_place, service_records


def pod(name, ns="infer", ip="127.5.1.1", labels=None, ready=True, hostname=None, subdomain=None, **extra):
    spec = {k: v for k, v in (("hostname", hostname), ("subdomain", subdomain)) if v}
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    meta = {"name": name, "namespace": ns, "labels": labels or {"app": "grp"}}
    meta.update(extra.pop("metadata", {}))
    return {"metadata": meta, "spec": spec,
            "status": {"podIP": ip, "phase": extra.pop("phase", "Running"), "conditions": conditions}}


def headless(name="grp", ns="infer", publish=False, selector=None):
    return {"metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": "None", "selector": selector or {"app": "grp"},
                     "publishNotReadyAddresses": publish}}


def test_a_pod_with_hostname_and_subdomain_gets_its_record_under_the_headless_service():
    records = service_records([headless()], [pod("grp-0", hostname="grp-0", subdomain="grp")])
    assert records == {"grp.infer.svc.cluster.local": ["127.5.1.1"],
                       "grp-0.grp.infer.svc.cluster.local": ["127.5.1.1"]}


def test_the_service_name_answers_every_ready_pod_it_selects():
    pods = [pod("a", ip="127.5.1.1"), pod("b", ip="127.5.1.2"), pod("c", ip="127.5.1.3", ready=False),
            pod("d", ip="127.5.1.4", labels={"app": "other"}), pod("e", ns="elsewhere", ip="127.5.1.5")]
    assert service_records([headless()], pods) == {"grp.infer.svc.cluster.local": ["127.5.1.1", "127.5.1.2"]}


def test_publish_not_ready_addresses_answers_pods_before_they_are_ready():
    # A multi-pod server's workers must find the leader before any of them is Ready.
    pods = [pod("leader", hostname="leader", subdomain="grp", ready=False)]
    assert "leader.grp.infer.svc.cluster.local" in service_records([headless(publish=True)], pods)
    assert service_records([headless(publish=False)], pods) == {}


def test_finished_terminating_and_unaddressed_pods_are_not_answered():
    pods = [pod("done", phase="Succeeded"), pod("going", metadata={"deletionTimestamp": "2026-01-01T00:00:00Z"}),
            pod("new", ip=None)]
    assert service_records([headless()], pods) == {}


def test_a_hostname_is_published_only_under_the_service_named_by_its_subdomain():
    records = service_records([headless("grp"), headless("other")],
                              [pod("p", hostname="p", subdomain="grp")])
    assert "p.grp.infer.svc.cluster.local" in records and "p.other.infer.svc.cluster.local" not in records
    assert records["other.infer.svc.cluster.local"] == ["127.5.1.1"]


def test_cluster_ip_services_and_services_without_selector_have_no_records():
    cluster_ip = {**headless(), "spec": {"clusterIP": "10.0.0.7", "selector": {"app": "grp"}}}
    no_selector = {**headless(), "spec": {"clusterIP": "None"}}
    assert service_records([cluster_ip, no_selector], [pod("a", hostname="a", subdomain="grp")]) == {}


def test_short_names_are_those_the_search_path_expands_from_the_pods_own_namespace():
    fqdn = "leader.grp.infer.svc.cluster.local"
    assert names_seen_from(fqdn, "infer") == [fqdn, "leader.grp.infer.svc", "leader.grp.infer", "leader.grp"]
    assert names_seen_from(fqdn, "other") == [fqdn, "leader.grp.infer.svc", "leader.grp.infer"]


def test_the_hosts_file_has_the_kubelets_lines_then_the_cluster_names():
    me = pod("grp-1", ip="127.5.1.2", hostname="grp-1", subdomain="grp")
    me["spec"]["hostAliases"] = [{"ip": "127.9.9.9", "hostnames": ["models.internal"]}]
    text = hosts_file(me, "127.5.1.2", {"grp-0.grp.infer.svc.cluster.local": ["127.5.1.1"]})
    lines = text.splitlines()
    assert lines[1] == "127.0.0.1\tlocalhost"
    assert "127.5.1.2\tgrp-1.grp.infer.svc.cluster.local\tgrp-1" in lines
    assert "127.9.9.9\tmodels.internal" in lines
    assert ("127.5.1.1\tgrp-0.grp.infer.svc.cluster.local grp-0.grp.infer.svc grp-0.grp.infer grp-0.grp"
            in lines)


def test_a_pod_without_subdomain_is_known_by_its_name():
    text = hosts_file(pod("web"), "127.5.1.1", {})
    assert text.splitlines()[-1] == "127.5.1.1\tweb"


def test_rewriting_keeps_the_inode_and_never_leaves_stale_names(tmp_path):
    path = tmp_path / "hosts"
    rewrite_in_place(path, "127.0.0.1 a-long-name-that-will-go\n")
    inode = path.stat().st_ino
    rewrite_in_place(path, "127.0.0.2 b\n")
    assert path.stat().st_ino == inode  # a bind mount of the file keeps seeing it
    assert path.read_text().split() == ["127.0.0.2", "b"]
