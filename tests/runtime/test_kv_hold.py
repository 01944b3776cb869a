"""The context server's KV hold: every hold ends within two leases — pulled, or at its lease, or
one lease after the last transfer that began reading it (while the lease ran) — and at once when
no transfer is needed after all (released: the request ended at its first token, or was aborted)."""

from adpfleet.runtime.engine.kv_cache import KVCacheManager
from adpfleet.runtime.engine.request import Request
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.executor.kv_hold import KVHold, LedgerPuller


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def held(lease_s=10.0, blocks=2):
    kv, clock, puller = KVCacheManager(8, 4), Clock(), LedgerPuller()
    hold = KVHold(kv, puller, lease_s, clock=clock)
    req = Request("r", [1] * (4 * blocks), SamplingParams(max_tokens=1), num_computed_tokens=4 * blocks)
    kv.grow(req, 4 * blocks)
    hold.hold(req)
    return hold, kv, clock


def test_a_pulled_hold_is_freed_at_the_next_reap():
    hold, kv, _ = held()
    assert hold.reap() == [] and kv.num_used_blocks == 2
    hold.puller_complete("r")
    assert hold.reap() == ["r"] and kv.num_used_blocks == 0 and hold.pulled == 1


def test_an_unpulled_hold_expires_at_its_lease():
    hold, kv, clock = held(lease_s=10)
    clock.now += 9.9
    assert hold.reap() == []
    clock.now += 0.1
    assert hold.reap() == ["r"] and kv.num_used_blocks == 0 and hold.expired == 1


def test_a_transfer_reading_the_blocks_delays_the_expiry():
    hold, kv, clock = held(lease_s=10)
    clock.now += 8
    (table, tokens), on_done = hold.lookup("r")
    assert tokens == 8 and len(table) == 2
    clock.now += 5  # past the lease, but the transfer is still reading
    assert hold.reap() == [] and kv.num_used_blocks == 2
    on_done()
    assert hold.reap() == ["r"] and hold.pulled == 1


def test_an_abandoned_transfer_cannot_pin_the_kv_forever():
    hold, kv, clock = held(lease_s=10)
    clock.now += 8
    hold.lookup("r")  # ...and the puller never confirms
    clock.now += 9.9  # one lease from the transfer's start, not yet
    assert hold.reap() == []
    clock.now += 0.1
    assert hold.reap() == ["r"] and kv.num_used_blocks == 0 and hold.expired == 1


def test_a_transfer_cannot_start_once_the_lease_has_run_out():
    hold, kv, clock = held(lease_s=10)
    clock.now += 10  # expired, not reaped yet
    assert hold.lookup("r") is None
    assert hold.reap() == ["r"]


def test_retried_transfers_cannot_pin_the_kv_past_two_leases():
    hold, kv, clock = held(lease_s=10)
    for _ in range(9):  # a transfer starts every pass, none confirms
        clock.now += 1
        hold.lookup("r")
    clock.now += 1
    assert hold.lookup("r") is None  # the lease ran out at 110: no new transfer
    clock.now = 118.9  # one lease after the last transfer began (at 109), not yet
    assert hold.reap() == []
    clock.now = 119
    assert hold.reap() == ["r"] and kv.num_used_blocks == 0  # within two leases of the hold


def test_held_blocks_await_a_pull_until_one_begins():
    """The split stall detection reads (adpfleet_kv_transfers_awaiting_pull): blocks no generation
    server has begun to pull are the generation side's; a pull under way or ended is the holder's."""
    hold, kv, clock = held(lease_s=10)
    assert hold.blocks_awaiting_pull == hold.blocks_in_flight == 2
    _, done = hold.lookup("r")
    assert hold.blocks_awaiting_pull == 0  # being pulled
    clock.now += 11
    assert hold.blocks_awaiting_pull == 2  # a pull that outlived its lease no longer counts as under way
    done()  # ended (acknowledged or not: a handle is pulled once)
    assert hold.blocks_awaiting_pull == 0 and hold.blocks_in_flight == 2  # not yet reaped
    assert hold.reap() == ["r"] and hold.blocks_in_flight == 0


def test_a_released_hold_is_freed_at_once_and_no_transfer_starts_on_it():
    hold, kv, _ = held()
    assert hold.release("r")
    assert kv.num_used_blocks == 0 and hold.held == {} and hold.released == 1  # no reap, no lease waited for
    assert hold.lookup("r") is None and hold.reap() == []
    assert not hold.release("r")  # released once


def test_a_hold_released_while_a_transfer_reads_it_goes_when_that_transfer_ends():
    hold, kv, clock = held(lease_s=10)
    _, on_done = hold.lookup("r")
    assert hold.release("r") and kv.num_used_blocks == 2  # the transfer's reads must not see reused blocks
    assert hold.lookup("r") is None  # but no other transfer starts on it
    on_done()
    assert hold.reap() == ["r"] and kv.num_used_blocks == 0


def test_a_hold_released_while_a_transfer_reads_it_goes_by_that_transfers_deadline_if_it_is_abandoned():
    hold, kv, clock = held(lease_s=10)
    hold.lookup("r")
    hold.release("r")
    clock.now += 9.9
    assert hold.reap() == []
    clock.now += 0.1
    assert hold.reap() == ["r"] and kv.num_used_blocks == 0
