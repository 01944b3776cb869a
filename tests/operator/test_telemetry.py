"""Liveness comes from the reconcile loops' heartbeats."""

from adpfleet.operator.telemetry import Heartbeats


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_an_operator_without_fleets_is_healthy():
    assert Heartbeats(resync_seconds=300, stuck_after=120).problems() == []


def test_a_pass_running_too_long_makes_the_operator_unhealthy():
    clock = Clock()
    beats = Heartbeats(resync_seconds=300, stuck_after=120, clock=clock)
    beats.started(("ns", "f"))
    clock.now = 100
    assert beats.problems() == []
    clock.now = 121
    assert beats.problems() == ["reconcile of ns/f has been running for 121 s"]
    beats.finished(("ns", "f"))
    assert beats.problems() == []


def test_a_loop_silent_longer_than_its_resync_period_makes_the_operator_unhealthy():
    clock = Clock()
    beats = Heartbeats(resync_seconds=300, stuck_after=120, clock=clock)
    beats.started(("ns", "f"))
    beats.finished(("ns", "f"))
    clock.now = 419
    assert beats.problems() == []
    clock.now = 421
    assert "has not run for 421 s" in beats.problems()[0]
    beats.forget(("ns", "f"))  # the fleet was deleted: its loop ended on purpose
    assert beats.problems() == []
