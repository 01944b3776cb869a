"""The local cluster's synthetic servers export the runtime's own exposition (the contract writes
both) and show the stall signatures by the contract's words."""

import pytest

from adpfleet.cluster.synthetic_metrics import Farm, SyntheticServer
from adpfleet.contract.signatures import Signature
from adpfleet.operator.adapters.dialects import ADPFLEET


def ranks(server: SyntheticServer, at: float):
    return ADPFLEET.parse(server.render(at).decode())


def test_a_synthetic_server_is_read_by_the_operator_like_a_real_one():
    moving = ranks(SyntheticServer("p", "f", "generation", "127.0.0.1", since=0.0), 10.0)
    assert set(moving) == {0, 1}
    assert moving[0].generation_tokens == 400 and moving[0].work == 2 and moving[0].ttft_count > 0


@pytest.mark.parametrize("signature, loop_spins", [(Signature.VETOED, True), (Signature.HUNG, False)])
def test_a_stall_freezes_the_tokens_and_the_signature_says_whether_the_loop_spins(signature, loop_spins):
    server = SyntheticServer("p", "f", "generation", "127.0.0.1", since=0.0, stalled_at=10.0, signature=signature)
    before, after = ranks(server, 10.0), ranks(server, 20.0)
    assert after[0].tokens == before[0].tokens and after[0].work > 0
    assert (after[0].iterations > before[0].iterations) is loop_spins
    assert (after[1].empty_batch_iterations > 0) is loop_spins  # rank 1 starves in the vetoed stall


def test_a_stall_is_asked_for_by_the_contracts_word_and_an_unknown_word_is_refused():
    farm = Farm()
    farm.servers["p"] = SyntheticServer("p", "f", "generation", "127.0.0.1")
    farm.stall("p", "hung")
    assert farm.servers["p"].signature is Signature.HUNG
    with pytest.raises(ValueError, match="'stuck' is not a valid Signature"):
        farm.stall("p", "stuck")
