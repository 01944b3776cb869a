"""Leader election over a coordination.k8s.io Lease, as client-go does it: pure decisions.

One Lease names the replica that acts (`holderIdentity`). The holder renews it every retry period;
the others read it every retry period and take it over once it has not changed for a whole lease
duration *as measured on their own clock* (the time they last saw it change, not the holder's
`renewTime`, so clocks need not agree). Every write carries the resourceVersion it was decided on:
of two replicas that decide to take over at once, the API server lets one through (409 for the
other).

The holder stops acting — the process exits — when it has not renewed for `renew_deadline`, which
is shorter than `lease_duration`: a replica cut off from the API server has stopped writing before
another can take over. `release` (on a graceful stop) hands the Lease back at once.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Timing:
    """Seconds. The takeover after a holder dies takes at most lease + 2 × retry (and the new
    leader's start-up); a holder cut off stops acting after `renew_deadline`."""
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def problem(self) -> str | None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            return (f"leader election needs 0 < retry period ({self.retry_period:g}) < renew deadline "
                    f"({self.renew_deadline:g}) < lease duration ({self.lease_duration:g})")
        return None

    @property
    def takeover_bound(self) -> float:
        """The longest a standby waits after the holder's last renewal (start-up not included)."""
        return self.lease_duration + 2 * self.retry_period


@dataclass(frozen=True)
class LeaseRecord:
    """What a Lease says (spec), and the version it was read at."""
    holder: str
    lease_duration_seconds: int
    acquire_time: str
    renew_time: str
    transitions: int
    resource_version: str

    @classmethod
    def from_lease(cls, lease: dict | None) -> "LeaseRecord | None":
        if lease is None:
            return None
        spec = lease.get("spec") or {}
        return cls(holder=spec.get("holderIdentity") or "", lease_duration_seconds=spec.get("leaseDurationSeconds") or 0,
                   acquire_time=spec.get("acquireTime") or "", renew_time=spec.get("renewTime") or "",
                   transitions=spec.get("leaseTransitions") or 0,
                   resource_version=(lease.get("metadata") or {}).get("resourceVersion", ""))


class Step(enum.Enum):
    CREATE = "create"   # no Lease yet: create it, holding it
    RENEW = "renew"     # ours: renew it
    TAKE = "take"       # released or expired: take it over
    WAIT = "wait"       # another replica's, alive


@dataclass(frozen=True)
class Observation:
    """A replica's view of the Lease: the record and when (its own monotonic clock) it last changed."""
    record: LeaseRecord | None
    changed_at: float


def observe(previous: Observation | None, record: LeaseRecord | None, now: float) -> Observation:
    """The new view after reading `record`: the change time moves only when the record changed."""
    if previous is not None and _same(previous.record, record):
        return replace(previous, record=record)
    return Observation(record, now)


def _same(a: LeaseRecord | None, b: LeaseRecord | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.holder, a.renew_time, a.transitions) == (b.holder, b.renew_time, b.transitions)


def decide(view: Observation, me: str, now: float, timing: Timing) -> Step:
    record = view.record
    if record is None:
        return Step.CREATE
    if record.holder == me:
        return Step.RENEW
    if not record.holder:
        return Step.TAKE
    duration = record.lease_duration_seconds or timing.lease_duration
    return Step.TAKE if now - view.changed_at >= duration else Step.WAIT


def lease_spec(record: LeaseRecord | None, me: str, step: Step, now_rfc3339: str, timing: Timing) -> dict:
    """The Lease spec to write for `step` (CREATE, RENEW or TAKE)."""
    taking = step is not Step.RENEW
    # whole seconds in the Lease, rounded up: a standby must never wait less than the holder's renew
    # deadline allows for
    return {"holderIdentity": me, "leaseDurationSeconds": math.ceil(timing.lease_duration),
            "acquireTime": now_rfc3339 if taking or record is None else record.acquire_time,
            "renewTime": now_rfc3339,
            "leaseTransitions": (record.transitions + 1 if record and taking else record.transitions if record else 0)}


def released_spec(record: LeaseRecord, now_rfc3339: str) -> dict:
    """Handing the Lease back: no holder, so a standby takes it on its next look."""
    return {"holderIdentity": "", "leaseDurationSeconds": 1, "acquireTime": record.acquire_time,
            "renewTime": now_rfc3339, "leaseTransitions": record.transitions}
