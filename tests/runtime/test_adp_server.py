"""A two-rank server over HTTP: per-rank metrics from start-up, counted once."""

import re
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from servers import Server, listening

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("--model", "tiny", "--dp", "2", "--role", "aggregated", "--kv-blocks", "32",
               log_path=tmp_path_factory.mktemp("adp") / "server.log")
    try:
        yield s.wait_healthy()
    finally:
        s.stop()


def sample(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_every_rank_exports_every_counter_at_zero_from_startup(server):
    text = httpx.get(server.url + "/metrics").text
    for rank in ("0", "1"):
        for name in ("adpfleet_forward_vetoed_total", "adpfleet_empty_batch_iterations_total",
                     "adpfleet_prompt_tokens_total", "adpfleet_generation_tokens_total"):
            assert re.search(rf'^{name}{{role="aggregated",rank="{rank}"}} 0\.0$', text, re.M), (name, rank)
        assert sample(text, "adpfleet_padding_dummies_total", rank=rank) == 0
        assert text.count(f'adpfleet_padding_dummies_total{{role="aggregated",rank="{rank}"') == 8


def test_concurrent_requests_are_spread_over_ranks_and_counted_once(server):
    n = 6

    def post(i):
        return httpx.post(server.url + "/v1/completions", json={"prompt": f"req {i}", "max_tokens": 5,
                                                                "temperature": 0, "ignore_eos": True}, timeout=60)

    with ThreadPoolExecutor(n) as pool:
        assert all(r.status_code == 200 for r in pool.map(post, range(n)))
    text = httpx.get(server.url + "/metrics").text
    finished = [sample(text, "adpfleet_requests_finished_total", rank=r) for r in ("0", "1")]
    assert sum(finished) == n and min(finished) > 0
    assert sample(text, "adpfleet_generation_tokens_total") == n * 5


def test_every_port_of_a_server_listens_on_its_host_only(server):
    """Issue 25: rank 0's rendezvous store listened on every interface whatever --host said. (gloo's
    own ports listen on the address the machine's hostname resolves to.)"""
    allowed = {"127.0.0.1"} | {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    addresses = listening(server)
    assert len(addresses) > 2 and {ip for ip, _ in addresses} <= allowed, addresses
