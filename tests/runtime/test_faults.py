"""Fault injection makes each stall signature on purpose, and only when enabled."""

import threading
import time

import httpx
import pytest

from adpfleet.runtime.executor.kv_transfer import KVLayout, fetch
from adpfleet.runtime.model.tiny import tiny_config

from servers import Server, metric, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def background(server, n=4, max_tokens=400):
    def one(i):
        try:
            httpx.post(server.url + "/v1/completions", json={"prompt": f"load {i}", "max_tokens": max_tokens,
                                                             "ignore_eos": True}, timeout=120)
        except httpx.HTTPError:
            pass
    for i in range(n):
        threading.Thread(target=one, args=(i,), daemon=True).start()


def test_faults_are_refused_unless_enabled(tmp_path):
    s = Server("--model", "tiny", log_path=tmp_path / "s.log")
    try:
        s.wait_healthy()
        assert httpx.post(s.url + "/faults", json={"kind": "freeze"}).status_code == 404
    finally:
        s.stop()


def test_a_frozen_rank_stops_every_ranks_iterations_while_health_still_answers(tmp_path):
    s = Server("--model", "tiny", "--dp", "2", "--fault-injection", "--collective-timeout", "60",
               log_path=tmp_path / "s.log")
    try:
        s.wait_healthy()
        assert httpx.post(s.url + "/faults", json={"kind": "bogus"}).status_code == 400
        background(s)
        assert wait_until(lambda: metric(s, "adpfleet_generation_tokens_total") > 20, 60)
        assert httpx.post(s.url + "/faults", json={"kind": "freeze", "rank": 1}).json()["rank"] == 1
        time.sleep(1.0)  # let the last stats arrive
        before = [metric(s, "adpfleet_iterations_total", rank=r) for r in (0, 1)]
        tokens = metric(s, "adpfleet_generation_tokens_total")
        assert not wait_until(lambda: metric(s, "adpfleet_generation_tokens_total") > tokens, 3)
        assert [metric(s, "adpfleet_iterations_total", rank=r) for r in (0, 1)] == before
        assert httpx.get(s.url + "/health").status_code == 200  # alive, Ready, and stuck
        assert metric(s, "adpfleet_requests_running") > 0
    finally:
        s.stop()


def test_a_starved_rank_without_padding_vetoes_the_fleet(tmp_path):
    s = Server("--model", "tiny", "--dp", "2", "--fault-injection", "--no-pad-empty-batch",
               log_path=tmp_path / "s.log")
    try:
        s.wait_healthy()
        httpx.post(s.url + "/faults", json={"kind": "starve", "rank": 0}).raise_for_status()
        background(s, n=4, max_tokens=50)
        assert wait_until(lambda: metric(s, "adpfleet_empty_batch_iterations_total", rank=0) > 50, 30)
        tokens = metric(s, "adpfleet_generation_tokens_total") + metric(s, "adpfleet_prompt_tokens_total")
        vetoed = metric(s, "adpfleet_forward_vetoed_total", rank=1)
        assert wait_until(lambda: metric(s, "adpfleet_forward_vetoed_total", rank=1) > vetoed + 20, 10)
        assert metric(s, "adpfleet_generation_tokens_total") + metric(s, "adpfleet_prompt_tokens_total") == tokens
    finally:
        s.stop()


def test_stop_reaping_keeps_pulled_kv_held(tmp_path):
    cfg = tiny_config("tiny")
    s = Server("--model", "tiny", "--role", "context", "--fault-injection", "--kv-blocks", "64",
               log_path=tmp_path / "s.log")
    try:
        s.wait_healthy()
        assert httpx.post(s.url + "/faults", json={"kind": "stop-reaping"}).status_code == 200
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "held " * 20, "max_tokens": 8}, timeout=60).json()
        p = r["disaggregated_params"]
        layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, "float32")
        payload = fetch(p["kv_endpoint"], p["kv_handle"], 10, layout, len(p["prompt_token_ids"]))  # pulled, acked...
        assert payload.k.shape[1] == len(p["prompt_token_ids"])
        time.sleep(1.0)
        assert metric(s, "adpfleet_kv_transfers_in_flight") > 0  # ...and still held
        assert metric(s, "adpfleet_kv_cache_blocks_used") > 0
    finally:
        s.stop()
