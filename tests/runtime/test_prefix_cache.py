"""The prefix cache in the engine (runtime/engine/kv_cache.py): a hit skips the prefill of the
blocks it found, and the cache composes with chunked prefill, the context role's held KV, pulled
KV, ADP ranks with padding, and the command line. The block manager's own rules are in
test_kv_cache.py; greedy parity on and off for every architecture in test_parity.py; the
progress search covers its invariants under every event (test_progress_search.py)."""

import torch

from adpfleet.cli import build_parser
from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.request import RequestState
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.executor.kv_hold import KVHold, LedgerPuller
from adpfleet.runtime.model.loader import load_model
from lockstep import LockstepFleet

MODEL = load_model("tiny-dense")
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def engine(prefix_cache: bool = True, kv_hold=None, **kw) -> LLMEngine:
    cfg = dict(model="tiny-dense", kv_blocks=32, tokens_per_block=4, max_num_tokens=8, prefix_cache=prefix_cache)
    return LLMEngine(EngineConfig(**{**cfg, **kw}), model=MODEL, kv_hold=kv_hold)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_chunks(e: LLMEngine, request_id: str) -> list[tuple[int, int]]:
    """(first position, tokens) of each prefill chunk of `request_id` the forwards run."""
    seen, forward = [], e.runner.forward

    def recording(batch, pad_to=None):
        seen.extend((r.num_computed_tokens, n) for r, n in batch.context if r.request_id == request_id)
        return forward(batch, pad_to)

    e.runner.forward = recording
    return seen


def test_a_hit_skips_the_prefill_of_its_blocks_and_chunked_prefill_goes_on_from_the_first_token_not_found():
    e = engine()
    system = tokens(18, seed=1)  # 4 full blocks and 2 tokens
    e.generate([system + tokens(3, seed=2)], GREEDY)
    computed = e.stats.prompt_tokens
    chunks = prefill_chunks(e, "second")
    second = e.add_request(system + tokens(11, seed=3), GREEDY, "second")
    while not second.is_finished:
        e.step()
    assert chunks == [(16, 8), (24, 5)]  # chunks of max_num_tokens from the first uncached token
    assert e.stats.prompt_tokens - computed == 13
    assert (e.stats.prefix_cache_queries, e.stats.prefix_cache_hits) == (21 + 29, 16)


def test_the_context_role_keeps_the_prefixes_it_computed_held_or_pulled():
    puller = LedgerPuller()
    e = engine(kv_hold=lambda kv: KVHold(kv, puller, lease_s=60))
    system = tokens(16, seed=4)  # 4 blocks
    held = []
    for s in (5, 6):  # one after the other: a block is found once the pass that computed it ran
        held.append(e.add_request(system + tokens(5, seed=s), SamplingParams(max_tokens=1), f"r{s}"))
        while held[-1].request_id not in e.kv_hold.held:
            e.step()
    first, second = held
    assert second.block_table[:4] == first.block_table[:4]  # found in the first's held KV
    assert e.kv_hold.blocks_in_flight == len(set(first.block_table) | set(second.block_table)) == 6 + 2
    for rid in ("r5", "r6"):
        e.kv_hold.release(rid)
    e.step()  # pulled: reaped, their full blocks stay cached
    assert e.kv.num_used_blocks == 0 and e.kv.num_cached_blocks == 5 + 1
    later = e.add_request(system + tokens(2, seed=7), SamplingParams(max_tokens=1))
    e.step()
    assert e.stats.prefix_cache_hits == 16 + 16 and later.is_finished


class PulledKV:
    def __init__(self, e: LLMEngine, n: int):
        k_cache, _ = e.runner.kv_cache
        self.k = self.v = torch.zeros(k_cache.shape[0], n, *k_cache.shape[2:])

    def release(self) -> None:
        pass


def test_pulled_kv_is_neither_looked_up_nor_cached():
    """A generation rank receives each prompt's whole KV: a hit would save only a local copy of
    what was pulled already (docs/engine.md, "The prefix cache")."""
    e = engine()
    prompt = tokens(17, seed=8)
    for n in range(2):
        req = e.make_request(prompt, GREEDY, f"pulled-{n}")
        req.remote_kv, req.first_token_id, req.kv_payload = ("ctx:1", f"h{n}"), 5, PulledKV(e, len(prompt))
        e.pending.append(req)
        while not req.is_finished:
            e.step()
        assert len(req.output_token_ids) == 6
    assert e.kv.num_cached_blocks == 0 and e.stats.prefix_cache_queries == 0 and e.kv.num_used_blocks == 0


def test_two_adp_ranks_with_padding_generate_the_same_with_the_cache_on_and_off():
    """Each rank its own cache; turns land on the rank that holds the conversation, one rank
    idles now and then (its padding dummies come from a pool that holds cached blocks)."""
    system = tokens(13, seed=9)
    outputs, stats = {}, {}
    for on in (True, False):
        engines = [engine(on, kv_blocks=12) for _ in range(2)]
        fleet = LockstepFleet(engines)
        try:
            histories = [system + tokens(3, seed=10 + r) for r in range(2)]
            for turn in range(4):
                ranks = [0, 1] if turn % 2 == 0 else [turn // 2]  # the other rank idles: it pads
                reqs = {r: engines[r].make_request(histories[r], GREEDY, f"t{turn}-{r}") for r in ranks}
                fleet.step({r: [q] for r, q in reqs.items()})
                while not all(q.is_finished for q in reqs.values()):
                    fleet.step()
                for r, q in reqs.items():
                    histories[r] = q.all_token_ids + tokens(2, seed=20 + turn)
        finally:
            fleet.close()
        outputs[on], stats[on] = histories, [e.stats for e in engines]
    assert outputs[True] == outputs[False]
    assert all(s.prefix_cache_hits > 0 for s in stats[True]) and not any(s.prefix_cache_hits for s in stats[False])
    assert sum(s.padding_dummies[("pre_schedule", "committed")] for s in stats[True]) > 0
    assert all(s.forward_vetoed == 0 for s in stats[True])


def test_a_rank_whose_free_blocks_are_all_cached_pads_and_admits_as_an_empty_one():
    engines = [engine(kv_blocks=6) for _ in range(2)]
    idle = engines[0]
    idle.generate([tokens(8, seed=30 + i) for i in range(3)], SamplingParams(max_tokens=1))
    assert idle.kv._free == [] and idle.kv.num_cached_blocks == 6  # every free block holds a cached prefix
    fleet = LockstepFleet(engines)
    try:
        busy = engines[1].make_request(tokens(9, seed=40), GREEDY)
        result = fleet.step({1: [busy]})[0]
        assert result.ran and idle.stats.padding_dummies[("pre_schedule", "committed")] == 1
        assert idle.kv.evictions == 1  # the dummy took a cached block
        largest = idle.make_request(tokens(12, seed=41), SamplingParams(max_tokens=8))  # 5 blocks: all but the reserve
        fleet.step({0: [largest]})
        assert largest.state is not RequestState.WAITING and idle.kv.evictions == 2  # admitted at once
    finally:
        fleet.close()


def test_the_cache_is_on_by_default_and_no_prefix_cache_turns_it_off_for_serve_and_generate():
    assert EngineConfig().prefix_cache is True and LLMEngine(EngineConfig(model="tiny-dense"), model=MODEL).kv.prefix_cache
    for command in (["serve"], ["generate", "hi"]):
        assert EngineConfig.from_args(build_parser().parse_args(command)).prefix_cache is True
        assert EngineConfig.from_args(build_parser().parse_args(command + ["--no-prefix-cache"])).prefix_cache is False
