"""Speculative decoding by prompt lookup: proposals, verification, parity with plain decoding
(engine and ADP executor), acceptance accounting, KV rollback, and its meeting with padding and
chunked prefill."""

import pytest

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine import attention_metadata
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.request import Request
from adpfleet.runtime.engine.sampling import InvalidRequestError, SamplingParams
from adpfleet.runtime.engine.spec_decode import PromptLookup, verify
from adpfleet.runtime.model.loader import load_model
from lockstep import LockstepFleet

MODELS = {name: load_model(name) for name in ("tiny", "tiny-dense")}
# repetitive prompts (where prompt lookup shines), a short one, and free text
PROMPTS = ["abcabcabcabcabc", "the cat sat on the mat; the cat sat on the", "x",
           "ADP ranks step in lockstep; " * 3, "0123456789" * 2]


def engine(model="tiny-dense", **kw) -> LLMEngine:
    cfg = dict(model=model, kv_blocks=96, tokens_per_block=4, max_num_tokens=64)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), model=MODELS[model])


def generate(e: LLMEngine, prompts=PROMPTS, **params) -> list[list[int]]:
    params = {"max_tokens": 24, "ignore_eos": True, **params}
    return [r.output_token_ids for r in e.generate(prompts, SamplingParams(**params))]


# -- proposing and verifying -----------------------------------------------------------------------

def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    assert PromptLookup(1, 3).propose([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 3) == [9, 2, 3]  # the 3-gram wins
    assert PromptLookup(1, 3).propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # its latest occurrence
    assert PromptLookup(1, 3).propose([4, 2, 3, 9, 5, 3], 2) == [9, 5]  # only the 1-gram matches
    assert PromptLookup(2, 3).propose([4, 2, 3, 9, 5, 3], 2) == [3, 3]  # below the minimum n: no match


def test_a_recent_occurrence_is_continued_periodically():
    assert PromptLookup(1, 2).propose([7, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_without_a_match_the_draft_repeats_the_last_token():
    assert PromptLookup(1, 3).propose([5, 6, 7], 3) == [7, 7, 7]


def test_the_index_grows_with_the_sequence():
    lookup, seq = PromptLookup(1, 2), [1, 2, 3]
    assert lookup.propose(seq, 2) == [3, 3]
    seq += [4, 1, 2]
    assert lookup.propose(seq, 2) == [3, 4]


def test_verification_emits_target_tokens_while_the_drafts_match_and_samples_lazily():
    calls = []

    def target(i):
        calls.append(i)
        return [10, 11, 12, 13][i]

    assert verify([10, 11, 99], target) == [10, 11, 12] and calls == [0, 1, 2]
    calls.clear()
    assert verify([5, 11, 12], target) == [10] and calls == [0]  # one draw per emitted token
    calls.clear()
    assert verify([10, 11, 12], target) == [10, 11, 12, 13]  # every draft right: 1 + k tokens


# -- parity with plain decoding --------------------------------------------------------------------

@pytest.mark.parametrize("model", ["tiny", "tiny-dense"])
@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_greedy_output_is_token_identical_with_and_without_drafting(model, draft_tokens):
    expected = generate(engine(model))
    e = engine(model, draft_tokens=draft_tokens)
    assert generate(e) == expected
    assert e.stats.spec_decode_accepted_tokens > 0  # drafts were really accepted, not only rejected


def test_parity_holds_with_chunked_prefill_and_small_blocks():
    kw = dict(max_num_tokens=9, tokens_per_block=2, max_batch_size=3)  # 2 decodes of 4 + 1 chunk token
    expected = generate(engine(**kw))
    e = engine(draft_tokens=3, **kw)
    assert generate(e) == expected and e.stats.spec_decode_accepted_tokens > 0


def test_stop_tokens_and_strings_inside_accepted_drafts_cut_the_output_where_plain_decoding_would():
    plain = generate(engine(), max_tokens=40)
    stop_token = plain[0][5]  # a token the first prompt's output reaches
    for params in ({"stop_token_ids": [stop_token]}, {"stop": ["ca"]}):
        expected = [(r.output_token_ids, r.output_text, r.finish_reason)
                    for r in engine().generate(PROMPTS, SamplingParams(max_tokens=40, **params))]
        got = [(r.output_token_ids, r.output_text, r.finish_reason)
               for r in engine(draft_tokens=3).generate(PROMPTS, SamplingParams(max_tokens=40, **params))]
        assert got == expected


def test_a_seeded_sampled_request_draws_the_same_tokens_with_and_without_drafting():
    params = dict(temperature=0.7, seed=11, top_k=20)
    assert generate(engine(draft_tokens=2), **params) == generate(engine(), **params)


def test_draft_positions_past_the_models_last_position_are_harmless():
    limit = MODELS["tiny-dense"].cfg.max_position_embeddings
    prompt = [ord("a") + i % 3 for i in range(limit - 6)]
    kw = dict(kv_blocks=-(-(limit + 8) // 16) + 1, tokens_per_block=16, max_num_tokens=limit)
    expected = generate(engine(**kw), [prompt], max_tokens=6)
    assert generate(engine(draft_tokens=4, **kw), [prompt], max_tokens=6) == expected


# -- accounting and KV -----------------------------------------------------------------------------

def test_acceptance_is_counted_and_saves_decode_steps():
    plain, spec = engine(), engine(draft_tokens=3)
    decode_steps, accepted = [], []
    real_forward, real_sample = spec.runner.forward, spec.runner.sample

    def forward(batch, pad_to=None):
        decode_steps.append(len(batch.generation))
        return real_forward(batch, pad_to)

    def sample(batch, logits):
        out = real_sample(batch, logits)
        accepted.extend(len(out[r]) - 1 for r in batch.generation)
        return out

    spec.runner.forward, spec.runner.sample = forward, sample
    assert generate(spec) == generate(plain)
    s = spec.stats
    assert s.spec_decode_draft_tokens == 3 * sum(decode_steps)
    assert s.spec_decode_accepted_tokens == sum(accepted) > 0
    assert s.generation_tokens == plain.stats.generation_tokens == 24 * len(PROMPTS)
    assert s.forward_steps < plain.stats.forward_steps  # fewer passes for the same tokens
    assert plain.stats.spec_decode_draft_tokens == plain.stats.spec_decode_accepted_tokens == 0


def test_rejected_drafts_give_their_kv_back():
    e = engine(draft_tokens=3, kv_blocks=64)
    reqs = [e.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS]
    while not all(r.is_finished for r in reqs):
        e.step()
        for r in e.active:
            assert len(r.block_table) == e.kv.blocks_for(r.num_computed_tokens), r.request_id
            if r.output_token_ids:
                assert r.num_computed_tokens == r.num_tokens - 1  # only the newest token is not cached
    assert e.kv.num_used_blocks == 0 and e.kv.num_available_blocks == e.kv.num_blocks


def test_admission_reserves_the_draft_lookahead():
    e = engine(draft_tokens=3, kv_blocks=8, tokens_per_block=4)
    req = e.add_request([1] * 10, SamplingParams(max_tokens=6))  # 16 tokens + 3 drafts: 5 blocks
    e.step()
    assert req.reserved_blocks == 5


# -- configuration and validation ------------------------------------------------------------------

@pytest.mark.parametrize("kw, flag", [(dict(draft_tokens=-1), "--draft-tokens"),
                                      (dict(prompt_lookup_min=0), "--prompt-lookup-min"),
                                      (dict(prompt_lookup_min=4, prompt_lookup_max=3), "--prompt-lookup-min"),
                                      (dict(draft_tokens=4, max_num_tokens=4), "--max-num-tokens")])
def test_bad_settings_are_refused_naming_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        EngineConfig(**kw).validate()


def test_a_request_that_fits_only_without_the_lookahead_and_the_reserve_is_refused():
    e = engine(draft_tokens=3, kv_blocks=8, tokens_per_block=4)  # 32 tokens - 1 reserve block - 3 drafts
    assert e.config.max_request_tokens == 25
    e.make_request([1] * 20, SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequestError) as err:
        e.make_request([1] * 20, SamplingParams(max_tokens=6))
    assert err.value.param == "max_tokens" and "25 tokens" in str(err.value)


# -- with padding: the generation dummy and the padded forward ---------------------------------------

@pytest.mark.parametrize("tokens_per_block", [1, 4])
def test_padding_a_forward_with_multi_token_dummy_decodes_keeps_uniform_decode(tokens_per_block):
    for pad_to in range(1, 12):  # whole dummy queries and a short remainder on the null block
        ids, pos, meta = attention_metadata.build([], tokens_per_block, decode_query_len=3, pad_to_tokens=pad_to)
        assert meta.num_tokens == pad_to and meta.num_decode_tokens == meta.num_decodes * 3
        assert int(meta.slot_mapping.max()) < tokens_per_block  # every padding token writes the null block


def test_two_adp_ranks_with_drafting_generate_what_one_rank_does_without():
    """Two real executors in lockstep (vote, padding, pad_to), drafting 2 tokens per step; one
    rank is starved by held KV for a while (a post-schedule dummy of 3 tokens) and one rank idles
    at the end (pre-schedule dummies)."""
    expected = generate(engine(), max_tokens=16)
    engines = [engine(draft_tokens=2, kv_blocks=32, tokens_per_block=4, max_num_tokens=16) for _ in range(2)]
    blocker = Request("held", [1] * 120, SamplingParams(max_tokens=1))
    engines[0].kv.grow(blocker, 120)  # 30 of rank 0's 32 blocks taken, as by a held transfer
    fleet = LockstepFleet(engines)
    try:
        reqs = [engines[i % 2].add_request(p, SamplingParams(max_tokens=16, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
        for passes in range(400):
            if passes == 20:
                engines[0].kv.free(blocker)
            if all(r.is_finished for r in reqs):
                break
            fleet.step()
        assert [r.output_token_ids for r in reqs] == expected
        stats = [e.stats for e in engines]
        assert stats[0].padding_dummies[("post_schedule", "committed")] > 0
        assert sum(s.padding_dummies[("pre_schedule", "committed")] for s in stats) > 0
        assert sum(s.spec_decode_accepted_tokens for s in stats) > 0
        assert all(s.forward_vetoed == 0 for s in stats)
    finally:
        fleet.close()
