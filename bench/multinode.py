"""A server over two pods against one pod with the same ranks (issue 17): how long each takes to
come up, and to serve again after it loses a pod.

    .venv/bin/python bench/multinode.py [--rounds 2]

One local control plane and operator. Each round runs both arms, one after the other (the order
swapped every round), on one fleet each: one context server of 1 rank, the router, and one
generation server of 2 ADP ranks, either in one pod (`podsPerServer: 1`) or over two pods of one
rank each (`podsPerServer: 2`: the worker joins its leader through the role's headless Service).
Per arm and round:
  - create -> Ready: the fleet applied -> every generation pod Ready; -> the fleet Ready (router
    included);
  - failure -> serving: a generation pod deleted (the group's worker; the one pod otherwise) -> the
    first greedy completion through the router that answers as it did before.
Both arms' greedy answers must be token-identical. Prints a table and writes
bench/results/multinode.json; docs/operator.md cites it (tests/test_docs_figures.py checks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import format_table, machine_info, operator_cluster, wait  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "multinode.json"
NAMESPACE = "bench"
ARMS = {"one pod x 2 ranks": 1, "two pods x 1 rank": 2}
PROMPTS = ["The operator says", "A server over two pods", "Gang lifecycle"]
START_TIMEOUT = 300  # seconds: torch import and rank processes on two shared cores


def manifest(name: str, pods_per_server: int) -> dict:
    from adpfleet.operator.resource import names

    def role(ranks: int, pods: int) -> dict:
        return {"servers": 1, "adpRanks": ranks, "podsPerServer": pods, "terminationGracePeriodSeconds": 5,
                "probes": {"readinessPeriodSeconds": 1, "startupTimeoutSeconds": 120},
                "engine": {"kvBlocks": 64}}
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"image": "adpfleet:dev", "model": {"name": "tiny"},
                     "context": role(1, 1), "generation": role(2, pods_per_server)}}


def ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


class Arm:
    def __init__(self, cluster, name: str, pods_per_server: int):
        self.cluster, self.name, self.pods = cluster, name, pods_per_server

    def live(self) -> list:
        items = self.cluster.core.list_namespaced_pod(
            NAMESPACE, label_selector=f"adpfleet.io/fleet={self.name},adpfleet.io/role=generation").items
        return sorted((p for p in items if p.metadata.deletion_timestamp is None), key=lambda p: p.metadata.name)

    def group_ready(self, not_uids: frozenset = frozenset()) -> bool:
        pods = self.live()
        return len(pods) == self.pods and all(ready(p) and p.metadata.uid not in not_uids for p in pods)

    def fleet_ready(self) -> bool:
        from adpfleet.operator.resource import names
        fleet = self.cluster.custom.get_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL,
                                                                 self.name)
        status = fleet.get("status", {})
        cond = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})
        return cond.get("status") == "True" and status.get("observedGeneration") == fleet["metadata"]["generation"]

    def router(self) -> str:
        from adpfleet.operator.resource import names
        selector = ",".join(f"{k}={v}" for k, v in names.router_selector(self.name).items())
        pods = self.cluster.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        ip = next(p.status.pod_ip for p in pods if p.metadata.deletion_timestamp is None and ready(p))
        return f"http://{ip}:{names.ROUTER_HTTP_PORT}"

    def greedy(self, timeout: float = 120) -> list[str]:
        url = self.router()
        texts = []
        for prompt in PROMPTS:
            r = httpx.post(f"{url}/v1/completions", timeout=timeout,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
            r.raise_for_status()
            texts.append(r.json()["choices"][0]["text"])
        return texts

    def round(self) -> dict:
        from adpfleet.operator.resource import names
        custom, core = self.cluster.custom, self.cluster.core
        t0 = time.monotonic()
        custom.create_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL,
                                               manifest(self.name, self.pods))
        wait(self.group_ready, START_TIMEOUT, f"{self.name}: every generation pod Ready")
        pods_ready = time.monotonic() - t0
        wait(self.fleet_ready, START_TIMEOUT, f"{self.name}: the fleet Ready")
        fleet_ready = time.monotonic() - t0
        before = self.greedy()

        pods = self.live()
        victim = pods[-1]  # the worker of a group (j = 1), the only pod otherwise
        old = frozenset(p.metadata.uid for p in pods)
        t1 = time.monotonic()
        core.delete_namespaced_pod(victim.metadata.name, NAMESPACE)
        wait(lambda: self.group_ready(old) and self.greedy(timeout=60) == before, START_TIMEOUT,
             f"{self.name}: serving again as before")
        serving = time.monotonic() - t1

        custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL, self.name)
        wait(lambda: not core.list_namespaced_pod(NAMESPACE, label_selector=f"adpfleet.io/fleet={self.name}").items,
             180, f"{self.name}'s pods gone")
        return {"create_to_pods_ready_s": round(pods_ready, 1), "create_to_fleet_ready_s": round(fleet_ready, 1),
                "failure_to_serving_s": round(serving, 1), "deleted": victim.metadata.name, "greedy": before}


METRICS = ("create_to_pods_ready_s", "create_to_fleet_ready_s", "failure_to_serving_s")


def run(args) -> dict:
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with operator_cluster("adpfleet-bench-multinode-", NAMESPACE) as cluster:
        for i in range(args.rounds):
            order = list(ARMS) if i % 2 == 0 else list(reversed(ARMS))
            for arm in order:
                row = Arm(cluster, f"mn{ARMS[arm]}r{i}", ARMS[arm]).round()
                print(f"round {i} {arm}: {json.dumps(row)}", flush=True)
                rounds[arm].append(row)
    arms = [{"arm": arm, "pods_per_server": ARMS[arm], "rounds": rows,
             **{m: round(statistics.median(r[m] for r in rows), 1) for m in METRICS}}
            for arm, rows in rounds.items()]
    one, two = arms
    return {"benchmark": "multinode", "rounds": args.rounds, "arms": arms,
            "ratio_two_pods_to_one": {m: round(two[m] / one[m], 2) for m in METRICS},
            "greedy_identical": all(r["greedy"] == one["rounds"][0]["greedy"] for a in arms for r in a["rounds"]),
            "machine": machine_info()}


def doc_rows(result: dict) -> list[str]:
    """The table docs/operator.md shows, one markdown row per arm and one for the ratio."""
    rows = [f"| {a['arm']} | {a['create_to_pods_ready_s']} s | {a['create_to_fleet_ready_s']} s | "
            f"{a['failure_to_serving_s']} s |" for a in result["arms"]]
    ratio = result["ratio_two_pods_to_one"]
    rows.append(f"| two pods / one pod | {ratio['create_to_pods_ready_s']:.2f}x | "
                f"{ratio['create_to_fleet_ready_s']:.2f}x | {ratio['failure_to_serving_s']:.2f}x |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    result = run(args)
    headers = ["arm", "create -> pods Ready s", "create -> fleet Ready s", "pod lost -> serving s"]
    print(format_table(headers, [[a["arm"], *(a[m] for m in METRICS)] for a in result["arms"]]))
    print(f"two pods / one pod: {result['ratio_two_pods_to_one']}; greedy identical: {result['greedy_identical']}")
    print("\n".join(doc_rows(result)))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if result["greedy_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
