"""A vLLM fleet through the operator's loops without a cluster: the stall controller scrapes its
servers in vLLM's dialect (the scripted /metrics are vLLM expositions, unreadable in adpfleet's),
judges and remediates them as an adpfleet fleet's; drains and autoscaling read vLLM's samples
(unknown values are not zeros); a drained server's recovery is detection's progress rule."""

from __future__ import annotations

import asyncio

import pytest

from adpfleet.operator.adapters.dialects import dialect_for
from adpfleet.operator.adapters.scrape import Scrape
from adpfleet.operator.decisions.autoscaling import role_load
from adpfleet.operator.drains import drained
from adpfleet.operator.remediator import Remediator
from adpfleet.operator.resource.vocabulary import Signature

from test_dialect_vllm import captured
from test_engines import vllm_spec
from test_stall_controller import T0, World, quick_drain, run  # noqa: F401 - quick_drain is an autouse fixture

VLLM = dialect_for("vllm")
SERVERS = ("llama-aggregated-0", "llama-aggregated-1")


def exposition(running=None, waiting=None, prompt=0, generation=0, steps=0, flops=None, usage=None) -> str:
    """One engine's /metrics as vLLM 0.32 writes them; a gauge left None is not published (an engine
    before its first step)."""
    values = {"vllm:num_requests_running": running, "vllm:num_requests_waiting": waiting,
              "vllm:kv_cache_usage_perc": usage, "vllm:prompt_tokens_total": prompt,
              "vllm:generation_tokens_total": generation, "vllm:iteration_tokens_total_count": steps,
              "vllm:estimated_flops_per_gpu_total": flops}
    lines = [f'{name}{{engine="0",model_name="tiny"}} {value}' for name, value in values.items() if value is not None]
    return "\n".join(lines + ['vllm:cache_config_info{engine="0",num_gpu_blocks="100"} 1.0']) + "\n"


def serving():
    state = {"n": 0}

    def text():
        state["n"] += 10
        return exposition(running=2, waiting=1, prompt=40, generation=state["n"], steps=state["n"], usage=0.1)
    return text


def frozen():
    return lambda: exposition(running=2, waiting=1, prompt=40, generation=500, steps=500, usage=0.1)


def long_prefill():
    """No token counted (the prompt's prefill is not done) but every step moves the FLOPs counter."""
    state = {"flops": 0.0}

    def text():
        state["flops"] += 1e9
        return exposition(running=1, waiting=0, prompt=0, generation=0, steps=0, flops=state["flops"], usage=0.3)
    return text


class VllmWorld(World):
    """Two aggregated vLLM servers; the scripted scrape reads its text in the dialect it is given."""

    def __init__(self, mode="Auto"):
        super().__init__(mode)
        spec = vllm_spec(servers=2, adpRanks=1)
        spec.update(monitoring=self.spec["monitoring"], remediation=self.spec["remediation"])
        self.spec = spec
        self.pods = {name: self._pod(name, "aggregated", f"127.0.9.{i + 1}", T0 - 3600)
                     for i, name in enumerate(SERVERS)}
        self.metrics = {"127.0.9.1": serving(), "127.0.9.2": serving()}

    async def scrape(self, url, timeout, dialect):
        self.now += 0.01
        text = self.metrics[url.split("//")[1].split(":")[0]]()
        return Scrape(at=self.now, ranks=dialect.parse(text), lockstep=dialect.lockstep)


def test_a_frozen_vllm_engine_is_hung_and_only_its_server_is_drained_and_replaced():
    w = VllmWorld()
    run(w.ticks(3))
    w.metrics["127.0.9.1"] = frozen()
    run(w.ticks(8))
    assert [c[:2] for c in w.api.calls if c[0] != "event"] == [("drain", SERVERS[0]), ("delete", SERVERS[0])]
    (record,) = w.records()
    assert (record["signature"], record["targets"], record["outcome"]) == ("hung", [SERVERS[0]], "Succeeded")
    (detected,) = w.api.events("StallDetected")
    assert SERVERS[0] in detected[2] and "hung, ranks 0" in detected[2]  # the engine label and the pod


def test_dry_run_on_a_vllm_fleet_records_and_deletes_nothing():
    w = VllmWorld(mode="DryRun")
    w.metrics["127.0.9.2"] = frozen()
    run(w.ticks(12))
    assert w.api.deletes() == [] and [r["outcome"] for r in w.records()] == ["DryRun"]
    assert w.records()[0]["signature"] == Signature.HUNG.value


def test_a_long_prefill_and_a_server_that_has_not_stepped_are_never_flagged():
    w = VllmWorld()
    w.metrics = {"127.0.9.1": long_prefill(), "127.0.9.2": lambda: exposition()}  # no queue gauges yet
    run(w.ticks(15))
    assert [c for c in w.api.calls] == []
    assert w.condition("Stalled")["status"] == "False"


def test_a_drained_vllm_server_whose_prefill_steps_again_has_recovered():
    before = Scrape(at=0.0, ranks=VLLM.parse(exposition(running=1, waiting=0, flops=1e9, usage=0.3)), lockstep=False)
    texts = iter([exposition(running=1, waiting=0, flops=1e9, usage=0.3),
                  exposition(running=1, waiting=0, flops=2e9, usage=0.3)])  # one prefill chunk: no token yet

    async def scraper(url, timeout, dialect):
        return Scrape(at=1.0, ranks=dialect.parse(next(texts)), lockstep=dialect.lockstep)
    pod = VllmWorld()._pod(SERVERS[0], "aggregated", "127.0.9.1", T0)
    remediation = Remediator(None, scraper, None, None, None)
    assert asyncio.run(remediation._progressed(pod, before, 5.0, VLLM))


def test_a_vllm_server_is_drained_when_its_engines_have_no_request_running_or_waiting():
    def read(name):
        return Scrape(at=0.0, ranks=VLLM.parse(captured(name)))
    assert not drained(read("under-load")) and not drained(read("dp2-under-load"))
    assert drained(read("idle-after-serving"))
    assert drained(read("dp2-started"))  # no engine has stepped: none has had a request


def test_a_vllm_roles_load_leaves_unknown_values_out_of_its_means():
    now = {"a": Scrape(at=5.0, ranks=VLLM.parse(captured("under-load"))),
           "b": Scrape(at=5.0, ranks=VLLM.parse(captured("dp2-started")))}  # two engines, no gauges yet
    load = role_load(5.0, now, {})
    sample = now["a"].ranks[0]
    assert (load.servers, load.ranks) == (2, 3)
    assert load.running_per_rank == pytest.approx(sample.requests_running)
    assert load.waiting_per_rank == pytest.approx(sample.requests_waiting)
    assert load.kv_cache_utilization == pytest.approx(sample.kv_cache_blocks_used / sample.kv_cache_capacity_blocks)
    assert load.transfer_share == 0.0


def test_a_vllm_roles_batch_capacity_is_its_max_num_seqs_or_vllms_default_for_the_device():
    from adpfleet.operator.resource.models import FleetSpec
    from adpfleet.operator.scaling import batch_capacity

    def capacity(args, **aggregated):
        spec = vllm_spec(**aggregated)
        spec["vllm"]["args"] = args
        return batch_capacity(FleetSpec.model_validate(spec), "aggregated")
    assert capacity(["--max-num-seqs", "48"]) == 48 and capacity(["--max-num-seqs=12", "--dtype", "half"]) == 12
    assert capacity([]) == 128  # vLLM's CPU default for an API server
    assert capacity([], gpusPerServer=2, engine={"device": "cuda"}) == 256
