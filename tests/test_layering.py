"""The import graph of the whole package has the shape the code is meant to have: no cycle between
modules, and in each tower no import from a lower floor to a higher one (a floor may import its own
floor and every floor below it). The towers meet only in the CLI and on the contract floor
(`adpfleet/contract/` and the model-source URI: standard library only, importing nothing above
itself), which every tower may import: the runtime and the operator never import each other (the
operator's image has no torch), and the local cluster (development infrastructure) is imported by
the CLI and the demo only.

Imports are read with `ast` from every module, wherever they stand (a function-local or a
type-only import is a dependency too). `KNOWN_VIOLATIONS` lists the violations someone is removing
right now, each with its owner; the test fails on any other violation, and on a listed one that is
gone — so the list only shrinks: delete its line when the work lands.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"adpfleet": "adpfleet", "runtime": "adpfleet.runtime", "operator": "adpfleet.operator",
                "cluster": "adpfleet.cluster"}  # pyproject's package-dir

# Each tower's floors, top first. A module belongs to the floor of the longest prefix that names it
# (a package or a module); a tower's own package belongs to its top floor.
FLOORS = {
    "runtime": [
        ("entry: CLI, HTTP server, router", ["adpfleet.runtime", "adpfleet.runtime.server",
                                             "adpfleet.runtime.generate", "adpfleet.runtime.serving",
                                             "adpfleet.runtime.router"]),
        ("executor: the ADP loop, padding, the vote, ranks", ["adpfleet.runtime.executor"]),
        ("engine: requests, KV cache, schedulers, attention metadata, sampling", ["adpfleet.runtime.engine"]),
        ("model: architectures, parallel layers, weights, tokenizer", ["adpfleet.runtime.model",
                                                                       "adpfleet.runtime.tokenizer"]),
        ("shared: config, metrics, the CPU budget", ["adpfleet.runtime.config", "adpfleet.runtime.metrics",
                                                     "adpfleet.runtime.cpu_budget"]),
    ],
    "operator": [
        ("entry: process, kopf handlers, webhook, HTTP endpoints", ["adpfleet.operator", "adpfleet.operator.main",
                                                                     "adpfleet.operator.handlers",
                                                                     "adpfleet.operator.alerts",
                                                                     "adpfleet.operator.httpserver"]),
        ("controllers: reconcile loop and pass, stall loop, alert inbox, leader election", ["adpfleet.operator.loops",
                                                                           "adpfleet.operator.reconciler",
                                                                           "adpfleet.operator.stall",
                                                                           "adpfleet.operator.stall_look",
                                                                           "adpfleet.operator.stall_detection",
                                                                           "adpfleet.operator.stall_rechecks",
                                                                           "adpfleet.operator.stall_episodes",
                                                                           "adpfleet.operator.stall_leftover",
                                                                           "adpfleet.operator.stall_events",
                                                                           "adpfleet.operator.stall_share",
                                                                           "adpfleet.operator.remediator",
                                                                           "adpfleet.operator.scaling",
                                                                           "adpfleet.operator.drains",
                                                                           "adpfleet.operator.inbox",
                                                                           "adpfleet.operator.election"]),
        ("decisions: pure functions", ["adpfleet.operator.decisions"]),
        ("adapters: the Kubernetes API, scraping", ["adpfleet.operator.adapters"]),
        ("resource: models, vocabulary, names; telemetry", ["adpfleet.operator.resource",
                                                            "adpfleet.operator.telemetry"]),
    ],
    "cluster": [
        ("local control plane and node agent", ["adpfleet.cluster"]),
    ],
    "contracts": [
        ("what the towers share, standard library only", ["adpfleet.contract", "adpfleet.model_uri"]),
    ],
    "cli": [
        ("the command line and the demo: may import every tower", ["adpfleet"]),
    ],
}
MAY_IMPORT = {"runtime": {"runtime", "contracts"}, "operator": {"operator", "contracts"},
              "cluster": {"cluster", "contracts"}, "contracts": {"contracts"}, "cli": {"cli", "runtime", "operator", "cluster", "contracts"}}
# Third-party modules the pure decisions must not touch (they talk to the world).
IMPURE = ("kubernetes", "kopf", "aiohttp", "httpx", "asyncio", "socket", "subprocess", "requests")

KNOWN_VIOLATIONS = {
    # violation -> who is removing it
}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(the package's modules `name` imports, the top-level names of everything else it imports)."""
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "adpfleet":
                outside.add(target.split(".")[0])
                continue
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                inside.add(target)
    return inside, outside


def placement(name: str) -> tuple[str, int, str]:
    """(tower, floor number from the top, floor) of a module."""
    best = None
    for tower, floors in FLOORS.items():
        for number, (floor, prefixes) in enumerate(floors):
            for prefix in prefixes:
                if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), tower, number, floor)
    assert best is not None, f"{name} is on no floor: add it to FLOORS in {Path(__file__).name}"
    return best[1], best[2], best[3]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def violations() -> dict[str, str]:
    """Every violation of the shape, with what it is."""
    known = modules()
    graph, third_party = {}, {}
    for name, path in known.items():
        graph[name], third_party[name] = imports(name, path, known)
    out = {}
    for component in cycles(graph):
        out["cycle: " + ", ".join(component)] = "modules that import each other"
    for name, targets in sorted(graph.items()):
        tower, floor, floor_name = placement(name)
        for target in sorted(targets):
            other, other_floor, other_name = placement(target)
            if other not in MAY_IMPORT[tower]:
                out[f"across: {name} -> {target}"] = f"the {tower} tower imports the {other} tower"
            elif other == tower and other_floor < floor:
                out[f"upward: {name} -> {target}"] = f"'{floor_name}' imports the higher floor '{other_name}'"
        if name.startswith("adpfleet.operator.decisions"):
            for lib in sorted(third_party[name] & set(IMPURE)):
                out[f"impure: {name} imports {lib}"] = "decisions are pure functions: no I/O"
        if tower == "contracts":
            for lib in sorted(third_party[name] - set(sys.stdlib_module_names) - {"__future__"}):
                out[f"not stdlib: {name} imports {lib}"] = "a shared contract is standard library only"
        if tower in ("operator", "cluster", "contracts") and "torch" in third_party[name]:
            out[f"torch: {name}"] = "the operator's image has no torch"
    return out


def test_every_module_is_on_a_floor_of_its_tower():
    for name in modules():
        placement(name)


def test_no_cycles_and_no_import_from_a_lower_floor_to_a_higher_one():
    found = violations()
    new = {v: why for v, why in found.items() if v not in KNOWN_VIOLATIONS}
    assert not new, "the import graph broke the layering:\n" + "\n".join(f"  {v}  ({why})" for v, why in new.items())


def test_known_violations_only_shrink():
    found = violations()
    gone = [v for v in KNOWN_VIOLATIONS if v not in found]
    assert not gone, ("fixed, so delete from KNOWN_VIOLATIONS in tests/test_layering.py:\n" +
                      "\n".join(f"  {v}  ({KNOWN_VIOLATIONS[v]})" for v in gone))


@pytest.mark.parametrize("source, importer, imported, kind", [
    ("from adpfleet.operator.stall import StallController\n", "adpfleet.operator.decisions.remediation",
     "adpfleet.operator.stall", "upward"),
    ("import adpfleet.runtime.engine.llm_engine\n", "adpfleet.operator.reconciler",
     "adpfleet.runtime.engine.llm_engine", "across"),
    ("from adpfleet.cluster import testing\n", "adpfleet.runtime.server", "adpfleet.cluster.testing", "across"),
    ("from adpfleet.operator.resource import names\n", "adpfleet.model_uri", "adpfleet.operator.resource.names",
     "across"),
    ("from adpfleet.runtime.metrics import RankStats\n", "adpfleet.contract.exposition", "adpfleet.runtime.metrics",
     "across"),
    ("from adpfleet.cluster import synthetic_metrics\n", "adpfleet.contract.metrics",
     "adpfleet.cluster.synthetic_metrics", "across"),
    ("from adpfleet.contract import quantity\n", "adpfleet.cluster.agent.scheduling", "adpfleet.contract.quantity",
     "fine"),
    ("from adpfleet.contract.metrics import RankSample\n", "adpfleet.operator.decisions.detection",
     "adpfleet.contract.metrics", "fine"),
    ("from adpfleet.contract.env import API_KEY_ENV\n", "adpfleet.runtime.serving.auth", "adpfleet.contract.env",
     "fine"),
])
def test_the_check_sees_an_upward_or_crossing_import(tmp_path, source, importer, imported, kind):
    """The rules can fail: an import written where it does not belong is reported."""
    known = modules()
    path = tmp_path / "probe.py"
    path.write_text(source)
    inside, _ = imports(importer, path, known)
    assert imported in inside
    tower, floor, _ = placement(importer)
    other, other_floor, _ = placement(imported)
    found = "across" if other not in MAY_IMPORT[tower] else (
        "upward" if other == tower and other_floor < floor else "fine")
    assert found == kind


def test_the_contract_floor_may_import_only_the_standard_library(tmp_path, monkeypatch):
    """A contract module that imports a third-party library (here pydantic) is reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("import json\nfrom pydantic import BaseModel\n")
    known = modules()
    monkeypatch.setattr(sys.modules[__name__], "modules", lambda: {**known, "adpfleet.contract.probe": probe})
    assert set(violations()) == {"not stdlib: adpfleet.contract.probe imports pydantic"}


def test_the_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
