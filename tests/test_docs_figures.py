"""A figure the docs cite is the one its benchmark's JSON holds (both come from the same run)."""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_install_md_cites_the_time_to_ready_of_bench_results_install_json():
    seconds = json.loads((ROOT / "bench/results/install.json").read_text())["seconds"]
    page = (ROOT / "docs/install.md").read_text()
    assert "bench/results/install.json" in page
    cited = ["helm install, rollout status (operator Ready)", "fleet applied -> both servers Ready",
             "fleet applied -> fleet Ready (router included)", "fleet applied -> first completion"]
    missing = [f"{step}: {seconds[step]:.1f} s" for step in cited if f"{seconds[step]:.1f} s" not in page]
    assert missing == [], missing


def _table_rows(page: str, header: str) -> dict[str, list[str]]:
    """The rows of the markdown table whose header line starts with `header`, by first cell."""
    lines = page[page.index(header):].splitlines()
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_benchmarks_md_disagg_tables_are_bench_results_disagg_serving_json():
    result = json.loads((ROOT / "bench/results/disagg_serving.json").read_text())
    page = (ROOT / "docs/benchmarks.md").read_text()
    arms = _table_rows(page, "| arm | output tok/s |")
    assert set(arms) == {a["arm"] for a in result["arms"]}
    for arm in result["arms"]:
        expected = [f"{arm['output_tokens_per_s']}", f"{arm['requests_per_s']}",
                    f"{arm['ttft_ms']['p50']} ms", f"{arm['ttft_ms']['p99']} ms",
                    f"{arm['itl_ms']['p50']} ms", f"{arm['itl_ms']['p99']} ms"]
        assert arms[arm["arm"]] == expected, arm["arm"]
    payloads = _table_rows(page, "| payload | KV transfer GB/s |")
    assert set(payloads) == {p["payload"] for p in result["kv_transfer"]}
    for p in result["kv_transfer"]:
        expected = [f"{p['kv_transfer_gbps']}", f"{p['loopback_tcp_gbps']}", f"{p['ratio']:.2f}",
                    f"{p['loopback_tcp_persistent_gbps']}", f"{p['ratio_to_persistent']:.2f}"]
        assert payloads[p["payload"]] == expected, p["payload"]


def test_the_router_memory_figures_are_bench_results_router_memory_json():
    result = json.loads((ROOT / "bench/results/router_memory.json").read_text())
    page = (ROOT / "docs/benchmarks.md").read_text()
    for label, runs in result.items():
        for attack, r in runs.items():
            row = (f"| {label.split()[0]} | {attack} | {r['requests']} | {r['rss_before_mib']} MiB | "
                   f"{r['rss_peak_mib']} MiB | {r['rss_after_mib']} MiB |")
            assert row in page, row
    before = next(runs for label, runs in result.items() if label.startswith("before"))["over the value limit"]
    cited = f"from {before['rss_before_mib']:.0f} to {before['rss_peak_mib']:.0f} MiB"
    assert cited in " ".join((ROOT / "docs/security.md").read_text().split())


def test_readme_cites_the_recorded_demo_run_of_bench_results_demo_summary_json():
    demo = json.loads((ROOT / "bench/results/demo-summary.json").read_text())
    readme = " ".join((ROOT / "README.md").read_text().split())
    total = demo["requests_completed"] + demo["requests_failed"]
    cited = (f"detected its frozen rank {demo['detection_s']} s after the fault "
             f"({demo['stall_window_s']} s window, {demo['scrape_interval_s']} s scrapes) and was serving again "
             f"{demo['recovery_s']} s after it, with {demo['requests_failed']} of {total} requests failed "
             f"({demo['router_queued']:.0f} held in the router's queue and retried")
    assert cited in readme


def test_benchmarks_md_cites_the_autoscale_run_of_bench_results_autoscale_json():
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from autoscale import doc_rows

    result = json.loads((ROOT / "bench/results/autoscale.json").read_text())
    page = (ROOT / "docs/benchmarks.md").read_text()
    section = page[page.index("## Autoscaling"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    assert "bench/results/autoscale.json" in section and "autoscale.png" in section
    assert (ROOT / "bench/results/autoscale.png").stat().st_size > 10_000
    missing = [row for row in doc_rows(result) if row not in section]
    assert missing == [], missing
    policy = next(a for a in result["arms"] if a["arm"] == "policy")
    peak = next(a for a in result["arms"] if a["arm"] == "fixed-peak")
    ratio = f"{policy['server_seconds']['total'] / peak['server_seconds']['total']:.2f}x"
    serving = f"{policy['step_to_new_server_serving_s']:.1f} s"
    for page_name in ("docs/benchmarks.md", "docs/autoscaling.md"):
        text = (ROOT / page_name).read_text()
        assert ratio in text and serving in text, (page_name, ratio, serving)


def test_operator_md_cites_the_scrape_run_of_bench_results_operator_scale_detection_json():
    result = json.loads((ROOT / "bench/results/operator_scale_detection.json").read_text())
    page = (ROOT / "docs/operator.md").read_text()
    assert "bench/results/operator_scale_detection.json" in page
    rows = _table_rows(page, "| measure (detection and autoscaling on) |")
    before = result["before"]
    expected = {
        "scrapes per second at rest": [f"{result['steady_scrapes_per_second']:g} "
                                       f"({result['steady_scrapes_failed']} failed)", ""],
        "operator CPU at rest": [f"{result['operator_cpu_percent_steady']:.1f} % of one core "
                                 f"({result['operator_cpu_ms_per_scrape']:.2f} ms per scrape)", "< 50 %"],
        "the same, main's scraper before this change (same session)": [
            f"{before['operator_cpu_percent_steady']:.1f} % of one core "
            f"({before['operator_cpu_ms_per_scrape']:.2f} ms per scrape): "
            f"{before['operator_cpu_percent_steady'] / result['operator_cpu_percent_steady']:.1f}x; it fell behind: "
            f"{before['steady_scrapes_per_second']:g} scrapes/s, {before['steady_scrapes_failed']} failed, "
            f"p99 {before['scrape_latency_ms']['p99']} ms, "
            f"hang → decision {before['stall']['hung_to_decision_seconds']:.1f} s", ""],
        "operator RSS idle / peak / at rest": [f"{result['operator_rss_mb_idle']:.0f} / "
                                               f"{result['operator_rss_mb_peak']:.0f} / "
                                               f"{result['operator_rss_mb_steady']:.0f} MB", "< 250 MB"],
        "scrape latency p50 / p99": [f"{result['scrape_latency_ms']['p50']} / {result['scrape_latency_ms']['p99']} ms",
                                     ""],
        "a server hangs → the remediation decision": [
            f"{result['stall']['hung_to_decision_seconds']:.1f} s",
            f"≤ {result['stall_decision_bound_seconds']} s (window + 2 intervals)"],
    }
    assert rows == expected
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"it uses {result['operator_cpu_percent_steady']:.1f} % of a core "
            f"({before['operator_cpu_percent_steady'] / result['operator_cpu_percent_steady']:.1f}x less than with "
            f"httpx) and decides on a hung server {result['stall']['hung_to_decision_seconds']:.1f} s after it hangs "
            f"({result['stall_window_seconds']} s window)") in readme


def _remediation_tables() -> dict[str, list[str]]:
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("bench_remediation", ROOT / "bench" / "remediation.py")
    bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(bench)  # it puts bench/ and tests/operator/ on sys.path itself
    return bench.markdown_tables(json.loads((ROOT / "bench/results/remediation.json").read_text()))


def test_the_remediation_docs_cite_every_fault_row_of_bench_results_remediation_json():
    """docs/remediation.md holds the tables of the run (timings; what clients saw; frozen engines against
    the anchors), and docs/benchmarks.md what clients saw and the anchors, every row as bench/remediation.py
    renders it from the JSON."""
    tables = _remediation_tables()
    result = json.loads((ROOT / "bench/results/remediation.json").read_text())
    assert {r["servers_per_role"] for r in result["faults"]} >= {1, 2}  # the one- and two-server cases
    assert {r["fault"] for r in result["faults"]} >= {"freeze", "stop-serving-kv"}  # issue 14's two sides
    # issue 27: a frozen vLLM engine beside adpfleet's own, in the same run
    assert {(r["engine"], r["fault"]) for r in result["faults"]} >= {("adpfleet", "freeze"), ("vllm", "freeze")}
    assert len(tables["anchors"]) - 2 == sum(r["fault"] == "freeze" for r in result["faults"])
    for page, wanted in (("docs/remediation.md", tables["timing"] + tables["clients"] + tables["anchors"]),
                         ("docs/benchmarks.md", tables["clients"] + tables["anchors"])):
        lines = set((ROOT / page).read_text().splitlines())
        missing = [line for line in wanted if line not in lines]
        assert missing == [], f"{page} lacks these rows of bench/results/remediation.json: {missing}"


def test_operator_md_cites_the_multinode_run_of_bench_results_multinode_json():
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from multinode import doc_rows

    result = json.loads((ROOT / "bench/results/multinode.json").read_text())
    page = (ROOT / "docs/operator.md").read_text()
    assert "bench/results/multinode.json" in page and result["greedy_identical"]
    missing = [row for row in doc_rows(result) if row not in page]
    assert missing == [], missing


def test_operator_md_cites_the_vllm_cache_run_of_bench_results_vllm_cache_json():
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from vllm_cache import doc_rows

    result = json.loads((ROOT / "bench/results/vllm_cache.json").read_text())
    page = (ROOT / "docs/operator.md").read_text()
    assert "bench/results/vllm_cache.json" in page
    missing = [row for row in doc_rows(result) if row not in page]
    assert missing == [], missing


def test_benchmarks_md_prefix_routing_table_is_bench_results_prefix_routing_json():
    results = json.loads((ROOT / "bench/results/prefix_routing.json").read_text())["results"]
    page = (ROOT / "docs/benchmarks.md").read_text()
    table = page[page.index("| part | workload | arm | TTFT p50 ms |"):].split("\n\n")[0].splitlines()[2:]
    rows = {tuple(cells[:3]): cells[3:] for cells in ([c.strip().strip("*") for c in line.strip("|").split("|")]
                                                       for line in table)}
    arms = {(part, w, arm): a for part, body in results.items()
            for w, by_arm in body.get("workloads", {}).items() for arm, a in by_arm.items()}
    assert set(rows) == set(arms)
    for key, cells in rows.items():
        a = arms[key]
        r = a["vs_baseline_per_round_median"]
        imbalance = [a[f"pass_imbalance_{k}"] for k in ("mean", "p50", "p90", "p99")]
        over, vetoed = a["pass_imbalance_over_bound"], a["vetoed_passes"]
        expected = [f"{a['ttft_p50_s'] * 1000:,.0f}", f"{r['ttft_p50_s']:.2f}", f"{a['ttft_p99_s'] * 1000:,.0f}",
                    f"{r['ttft_p99_s']:.2f}", f"{a['throughput_tok_s']:.1f}", f"{r['throughput_tok_s']:.2f}",
                    f"{a['prefill_tokens']:,.0f}", f"{r['prefill_tokens']:.2f}", f"{a['hit_rate']:.2f}",
                    f"{a['hit_vs_ideal']:.2f}", "-" if imbalance[0] is None else " / ".join(f"{v:.2f}" for v in imbalance),
                    "-" if over is None else f"{over * 100:.0f} %", "-" if vetoed is None else f"{vetoed:.0f}"]
        assert [c.replace("**", "") for c in cells] == expected, key


def test_benchmarks_md_prefix_routing_tables_are_their_json():
    page = (ROOT / "docs/benchmarks.md").read_text()
    for name in ("prefix_routing.json", "prefix_routing-pressure.json"):
        assert f"bench/results/{name}" in page
        for part, p in json.loads((ROOT / "bench/results" / name).read_text())["results"].items():
            for workload, arms in p["workloads"].items():
                for arm, a in arms.items():
                    ratio = a["vs_baseline_per_round_median"]["ttft_p50_s"]
                    row = f"| {part} | {workload} | {arm} | {a['ttft_p50_s'] * 1000:,.0f} | {ratio:.2f} |"
                    split = (f"| {part} | {workload} | {arm} | {a['client_ttft_mean_s'] * 1000:,.0f} | "
                             f"{a['server_ttft_mean_s'] * 1000:,.0f} | {a['queue_mean_s'] * 1000:,.0f} | ")
                    assert row in page and split in page, (name, part, workload, arm)
