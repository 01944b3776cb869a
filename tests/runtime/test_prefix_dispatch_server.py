"""A real 2-rank server's ADP dispatcher through the official openai client: conversations follow
their cache, a hot prefix spreads within the bound, the router's rank hint is honoured or refused,
and the snapshot says what each rank holds."""

import asyncio

import httpx
import openai
import pytest

from adpfleet.runtime.engine import block_hash
from adpfleet.runtime.executor.adp_router import IMBALANCE_BOUND
from adpfleet.runtime.serving.rank_routing import RANK_HEADER, SNAPSHOT_PATH
from servers import metric, serve, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

B = 16  # the server's tokens per block (the default)
ROUTER, USER = "fleet-token", "user-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = serve("aggregated", tmp_path_factory.mktemp("dispatch"), "--kv-blocks", "128", "--api-key", USER, dp=2,
              env={"ADPFLEET_INTERNAL_TOKEN": ROUTER})
    try:
        yield s.wait_healthy(180)
    finally:
        s.stop()


def client(server, key: str = ROUTER) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def complete(server, prompt: list[int], max_tokens: int = 8, rank: int | None = None, key: str = ROUTER) -> list[int]:
    headers = {RANK_HEADER: str(rank)} if rank is not None else None
    answer = client(server, key).completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_headers=headers, extra_body={"ignore_eos": True})
    return answer.choices[0].text


def per_rank(server, name: str) -> list[float]:
    return [metric(server, name, rank=r) for r in (0, 1)]


def work(server) -> list[float]:
    """Tokens each rank computed: prompt tokens (hits skipped) and generated tokens."""
    return [p + g for p, g in zip(per_rank(server, "adpfleet_prompt_tokens_total"),
                                  per_rank(server, "adpfleet_generation_tokens_total"))]


def settled(server, finished: float) -> bool:
    """Until the ranks' stats count `finished` requests (stats follow the outputs on the pipe)."""
    return wait_until(lambda: sum(per_rank(server, "adpfleet_requests_finished_total")) >= finished, 30)


def test_turn_two_lands_on_the_rank_that_holds_turn_one(server):
    system = list(range(1, 49))  # 3 blocks
    for rank in (1, 0):  # the router placed turn 1; turn 2 comes without a hint
        turn1 = system + [100 + rank] * 20
        before = per_rank(server, "adpfleet_prefix_cache_hits_total")
        done = sum(per_rank(server, "adpfleet_requests_finished_total"))
        answer = complete(server, turn1, rank=rank)
        turn2 = turn1 + [200 + rank] * 8 + [150 + rank] * 10
        complete(server, turn2)
        assert settled(server, done + 2)
        hits = [a - b for a, b in zip(per_rank(server, "adpfleet_prefix_cache_hits_total"), before)]
        assert hits[rank] >= block_hash.matchable_blocks(len(turn1), B) * B and hits[1 - rank] == 0, (rank, hits)
        assert answer


def test_the_snapshot_lists_the_blocks_a_rank_computed_and_only_the_router_may_read_it(server):
    prompt = list(range(60, 60 + 40))
    complete(server, prompt, max_tokens=2, rank=1)
    want = {h.hex() for h in block_hash.block_hashes(prompt, B)}
    snap = httpx.get(server.url + SNAPSHOT_PATH, headers={"Authorization": f"Bearer {ROUTER}"}, timeout=10).json()
    assert snap["tokens_per_block"] == B and snap["imbalance_bound"] == IMBALANCE_BOUND
    assert want <= set(snap["ranks"][1]["blocks"]) and not want & set(snap["ranks"][0]["blocks"])
    user = httpx.get(server.url + SNAPSHOT_PATH, headers={"Authorization": f"Bearer {USER}"}, timeout=10)
    assert user.status_code == 403


def test_a_named_rank_is_honoured_and_greedy_output_is_the_same_on_either_rank_hit_or_miss(server):
    prompt = list(range(120, 120 + 50))
    before = per_rank(server, "adpfleet_requests_finished_total")
    answers = [complete(server, prompt, rank=1), complete(server, prompt, rank=1), complete(server, prompt, rank=0)]
    assert settled(server, sum(before) + 3)
    after = per_rank(server, "adpfleet_requests_finished_total")
    assert [a - b for a, b in zip(after, before)] == [1, 2]
    assert answers[0] == answers[1] == answers[2] == complete(server, prompt)  # miss, hit, miss, the dispatcher's


@pytest.mark.parametrize("value", ["2", "-1", "one"])
def test_a_rank_hint_that_names_no_rank_is_refused_with_400_naming_the_header(server, value):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=1,
                                          extra_headers={RANK_HEADER: value})
    assert refused.value.body["param"] == RANK_HEADER


def test_only_the_router_may_name_a_rank(server):
    with pytest.raises(openai.PermissionDeniedError):
        complete(server, [1, 2, 3], rank=0, key=USER)
    assert complete(server, [1, 2, 3], key=USER)  # the same request without the hint is served


SESSIONS, ARRIVAL_GAP_S = 24, 0.02


def test_a_hot_shared_prefix_spreads_over_the_ranks_within_the_bound(server):
    """Sessions arrive 20 ms apart (several passes: the dispatcher's view is current) and overlap
    (each decodes 64 tokens), all with one system prompt that rank 0 alone holds at first."""
    system = list(range(200, 296))  # 6 blocks every session shares
    complete(server, system + [7] * 8, max_tokens=1, rank=0)  # rank 0 holds it: affinity alone would pin all
    assert settled(server, sum(per_rank(server, "adpfleet_requests_finished_total")))
    before, done = work(server), sum(per_rank(server, "adpfleet_requests_finished_total"))

    async def session(c, i: int):
        await asyncio.sleep(i * ARRIVAL_GAP_S)
        await c.completions.create(model="tiny", prompt=system + [10 + i] * 16, max_tokens=64, temperature=0,
                                   extra_body={"ignore_eos": True})

    async def sessions():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=ROUTER, max_retries=0, timeout=120) as c:
            await asyncio.gather(*(session(c, i) for i in range(SESSIONS)))
    asyncio.run(sessions())
    assert settled(server, done + SESSIONS)
    spent = [a - b for a, b in zip(work(server), before)]
    assert min(spent) > 0 and max(spent) / (sum(spent) / 2) <= IMBALANCE_BOUND, spent
