"""An abort ends a request wherever it is on a rank — also while its prompt's KV is being pulled
(generation) and while its KV is held for a transfer (context). Real engines, the real KV transfer
over loopback, and real servers and rank processes where the path runs through them."""

import asyncio
import threading
import time

import httpx
import pytest

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.executor.kv_hold import KVHold, LedgerPuller
from adpfleet.runtime.executor.kv_transfer import KVLayout, KVPuller, KVTransferError, KVTransferServer, fetch
from adpfleet.runtime.model.loader import load_model

from servers import metric, serve, wait_until

MODEL = load_model("tiny")  # the model `serve()` runs: its KV travels to a real generation server
PROMPT = [(7 * i) % 300 + 3 for i in range(22)]  # 6 blocks of 4
LONG_LEASE_S = 600.0  # what an abort must not wait for


def context_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", kv_blocks=16, tokens_per_block=4), model=MODEL,
                     kv_hold=lambda kv: KVHold(kv, LedgerPuller(), LONG_LEASE_S))


def held_prompt(ctx: LLMEngine, rid: str = "held"):
    """A prompt run to its first token on a context engine: its KV held for a generation server."""
    req = ctx.add_request(PROMPT, SamplingParams(max_tokens=1), rid)
    while not req.is_finished:
        ctx.step()
    assert rid in ctx.kv_hold.held and ctx.kv.num_used_blocks == 6
    return req


def kv_server(ctx: LLMEngine, lookup=None) -> KVTransferServer:
    k_cache, v_cache = ctx.runner.kv_cache
    return KVTransferServer("127.0.0.1", 0, k_cache, v_cache, lookup or ctx.kv_hold.lookup,
                            ctx.kv.tokens_per_block)


def wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


# -- context: KV held for a transfer ---------------------------------------------------------------

def test_an_abort_frees_kv_held_for_a_transfer_at_once_and_no_pull_gets_it_after():
    ctx = context_engine()
    held_prompt(ctx)
    server = kv_server(ctx)
    try:
        assert ctx.abort("held")
        assert ctx.kv.num_used_blocks == 0 and ctx.kv_hold.held == {}  # at once, not at the lease's end
        ctx.refresh_gauges()
        assert ctx.stats.kv_transfers_in_flight == 0
        assert ctx.stats.requests_finished["length"] == 1 and ctx.stats.requests_finished["abort"] == 0
        with pytest.raises(KVTransferError, match="no held KV"):
            fetch(server.endpoint, "held", 5, KVLayout.of(ctx.runner.kv_cache[0]), len(PROMPT))
        assert not ctx.abort("held")  # nothing left of it
    finally:
        server.close()


@pytest.mark.multiproc
def test_a_context_request_whose_stream_is_closed_after_its_prompt_finished_frees_its_held_kv():
    """The client left just as the rank finished the prompt: the rank group has already forgotten the
    request (its last output is on its way), so only the rank the request went to can free its KV."""
    from adpfleet.runtime.serving.engine_client import EngineClient

    client = EngineClient(EngineConfig(model="tiny", kv_blocks=16, tokens_per_block=4), 1, "context",
                          kv_lease_s=LONG_LEASE_S)
    try:
        client.group.wait_ready(180)

        async def client_leaves_as_the_prompt_finishes():
            outputs = client.generate(client.make_request(PROMPT, SamplingParams(max_tokens=1), "gone"))
            first = asyncio.ensure_future(anext(outputs))
            await asyncio.sleep(0)  # one turn of the loop: submitted, waiting for its output
            # the event loop is held until the rank holds the KV: the finished output waits in the
            # loop's queue, unread, when the stream is closed
            assert wait_until(lambda: client.kv_held == 6, 60)
            assert client.group.dispatcher.placed == {}  # the rank group forgot it when the output passed
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
        asyncio.run(client_leaves_as_the_prompt_finishes())
        assert wait_until(lambda: client.kv_held == 0, 5)  # not after the 600 s lease
    finally:
        client.close()


# -- generation: KV being pulled -------------------------------------------------------------------

def test_an_abort_while_the_prompt_kv_is_pulled_cancels_the_request_and_the_pull_still_frees_the_context_kv():
    ctx = context_engine()
    held = held_prompt(ctx)
    server = kv_server(ctx)
    gen = LLMEngine(EngineConfig(model="tiny", kv_blocks=16, tokens_per_block=4), model=MODEL)
    puller = KVPuller(KVLayout.of(gen.runner.kv_cache[0]), 10.0)
    req = gen.make_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), "held")
    req.remote_kv, req.first_token_id = (server.endpoint, "held"), held.output_token_ids[0]
    try:
        gen.begin_pull(req)  # as a generation rank does when the request comes
        assert gen.abort("held")  # the client leaves while the KV is on its way
        payload = req.kv_payload = puller.pull(server.endpoint, "held", len(PROMPT))  # the pull runs to its end
        assert gen.end_pull(req, None) is None
        outputs = [out for _ in range(4) for out in gen.step()]
        assert outputs == [] and gen.active == [] and not gen.pending and gen.kv.num_used_blocks == 0
        assert gen.stats.generation_tokens == 0 and gen.stats.requests_finished["abort"] == 1
        assert payload.k is None  # what the pull brought was given back (its buffer takes the next pull)
        wait(lambda: ctx.kv_hold.reap() == ["held"])  # the ended transfer frees the context's KV
        assert ctx.kv.num_used_blocks == 0
    finally:
        puller.close()
        server.close()


def test_a_pull_that_fails_after_an_abort_fails_nothing():
    gen = LLMEngine(EngineConfig(model="tiny", kv_blocks=16, tokens_per_block=4), model=MODEL)
    req = gen.make_request(PROMPT, SamplingParams(max_tokens=8), "gone")
    req.remote_kv, req.first_token_id = ("127.0.0.1:1", "gone"), 5
    gen.begin_pull(req)
    assert gen.abort("gone")
    assert gen.end_pull(req, "KV transfer failed: refused") is None  # no error output for a stream that left
    assert gen.stats.requests_finished["abort"] == 1 and gen.stats.requests_finished["error"] == 0


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_client_that_leaves_while_its_kv_is_pulled_is_never_decoded(tmp_path):
    ctx = context_engine()
    held = held_prompt(ctx)
    transfer_may_start = threading.Event()

    def slow_lookup(handle):  # the pull is under way: connected, waiting for the context server
        transfer_may_start.wait(60)
        return ctx.kv_hold.lookup(handle)
    server = kv_server(ctx, slow_lookup)
    gen = serve("generation", tmp_path)  # loopback is an allowed KV peer
    try:
        gen.wait_healthy(180)
        body = {"prompt": "anything", "max_tokens": 12, "ignore_eos": True, "disaggregated_params": {
            "ctx_request_id": "held", "first_token_id": held.output_token_ids[0], "prompt_token_ids": PROMPT,
            "kv_endpoint": server.endpoint, "kv_handle": "held"}}
        with pytest.raises(httpx.ReadTimeout):  # the client leaves while the KV is on its way
            httpx.post(gen.url + "/v1/completions", json=body, timeout=2)
        assert wait_until(lambda: metric(gen, "adpfleet_requests_finished_total", finish_reason="abort") == 1, 10)
        transfer_may_start.set()  # the pull ends after the abort...
        wait(lambda: ctx.kv_hold.reap() == ["held"])  # ...and frees the context's KV
        time.sleep(1.0)  # many passes of an idle rank: a request that was added would decode now
        assert metric(gen, "adpfleet_generation_tokens_total") == 0
        assert metric(gen, "adpfleet_requests_running") == metric(gen, "adpfleet_requests_waiting") == 0
        assert metric(gen, "adpfleet_kv_cache_blocks_used") == 0
    finally:
        transfer_may_start.set()
        gen.stop()
        server.close()
