"""Fault injection makes each stall signature on purpose, and only when enabled (a server without
--fault-injection refuses them: test_server.py, on that module's server rather than one more start)."""

import threading
import time

import httpx
import pytest

from adpfleet.runtime.executor.kv_transfer import KVLayout, KVTransferError, fetch
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


def test_a_frozen_rank_stops_every_ranks_iterations_while_health_still_answers(tmp_path):
    s = Server("--model", "tiny", "--dp", "2", "--fault-injection", "--collective-timeout", "60",
               log_path=tmp_path / "s.log")
    try:
        s.wait_healthy()
        assert httpx.post(s.url + "/faults", json={"kind": "bogus"}).status_code == 400
        for kind in ("stop-reaping", "stop-serving-kv"):  # no held KV here: refused, the ranks untouched
            r = httpx.post(s.url + "/faults", json={"kind": kind})
            assert r.status_code == 400 and "context servers only" in r.text
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
        s.kill()  # a frozen rank never hears a stop: a SIGTERM would wait out the ranks' 20 s join


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


def test_held_kv_is_awaiting_pull_until_a_pull_begins_and_the_kv_faults_keep_it_held(tmp_path):
    cfg = tiny_config("tiny")
    layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, "float32")
    s = Server("--model", "tiny", "--role", "context", "--fault-injection", "--kv-blocks", "64",
               log_path=tmp_path / "s.log")

    def prompt(text: str) -> dict:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": text * 20, "max_tokens": 8}, timeout=60)
        return r.json()["disaggregated_params"]

    def held() -> tuple[float, float]:
        return metric(s, "adpfleet_kv_transfers_in_flight"), metric(s, "adpfleet_kv_transfers_awaiting_pull")
    try:
        s.wait_healthy()
        assert httpx.post(s.url + "/faults", json={"kind": "stop-reaping"}).status_code == 200
        p = prompt("held ")
        # nobody has pulled it: the KV is held for the generation side
        assert wait_until(lambda: held()[0] > 0 and held()[1] == held()[0], 10), held()
        payload = fetch(p["kv_endpoint"], p["kv_handle"], 10, layout, len(p["prompt_token_ids"]))  # pulled, acked...
        assert payload.k.shape[1] == len(p["prompt_token_ids"])
        # ...and still held: this server's own part (its pull completed), no longer awaiting one
        assert wait_until(lambda: held()[0] > 0 and held()[1] == 0, 10), held()
        assert metric(s, "adpfleet_kv_cache_blocks_used") > 0

        assert httpx.post(s.url + "/faults", json={"kind": "stop-serving-kv"}).status_code == 200
        before = held()[0]
        q = prompt("wedged ")
        with pytest.raises(KVTransferError, match="no complete transfer within"):  # it began, and never answers
            fetch(q["kv_endpoint"], q["kv_handle"], 2, layout, len(q["prompt_token_ids"]))
        assert wait_until(lambda: held()[0] > before and held()[1] == 0, 10), held()
    finally:
        s.stop()
