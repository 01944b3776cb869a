"""The words of stall detection and remediation, each defined once (docs/remediation.md), and the
status words more than one module says (condition types, shared reasons).

The CRD's enums (`spec.remediation`, `status.recentRemediations`, `status.conditions[].type`), the
decisions (`decisions/detection.py`, `decisions/remediation.py`, `decisions/conditions.py`), the
Events and the operator's metric labels all use these members. A new action or outcome is one line here
plus the rule that produces it; a new signature is one line in adpfleet/contract/signatures.py (the
local cluster's synthetic servers show signatures by those words too); `adpfleet crds` then carries
it into the CRD. Torch-free and dependency-free, so every floor may import it.
"""

from __future__ import annotations

import enum

from adpfleet.contract.signatures import Signature  # noqa: F401 - the words the local cluster's servers show too


class ServerState(str, enum.Enum):
    """What one server is doing, as its latest scrapes show (a stall verdict's state)."""
    PROGRESSING = "Progressing"  # produced real tokens within the window
    IDLE = "Idle"                # no work
    WARMING_UP = "WarmingUp"     # too few scrapes to cover the window (started, restarted, just seen)
    SUSPECT = "Suspect"          # no tokens while having work, not (yet) for a confirmed whole window
    STALLED = "Stalled"          # confirmed: act on it
    BLOCKED = "Blocked"          # no progress only because a peer does not take its work: the peer's stall
    UNREACHABLE = "Unreachable"  # the latest scrape failed: reported, never acted on as a stall


class Action(str, enum.Enum):
    """What remediation does about a stalled server (the rungs of the escalation ladder)."""
    RESTART_SERVER = "RestartServer"  # drain it, delete its pod(s); the reconcile recreates them
    RESTART_PEERS = "RestartPeers"    # the other role's servers, the ones it waits on, in batches
    RESTART_ROLE = "RestartRole"      # every server of its role, in batches
    HALT = "Halt"                     # stop remediating the fleet; Degraded until a person looks

    @property
    def restarts(self) -> bool:
        """Deletes pods (and so spends budget and may be in progress)."""
        return self is not Action.HALT

    @property
    def rolling(self) -> bool:
        """Restarts its targets a batch at a time, each batch Ready again before the next."""
        return self in (Action.RESTART_PEERS, Action.RESTART_ROLE)

    @property
    def event_reason(self) -> str:
        """The Event that announces the action (`RestartingServer`, ..., `RemediationHalted`)."""
        return Reason.REMEDIATION_HALTED if self is Action.HALT else "Restarting" + self.value.removeprefix("Restart")


class Outcome(str, enum.Enum):
    """Where one recorded remediation stands (`status.recentRemediations[].outcome`)."""
    PENDING = "Pending"        # decided and recorded; being carried out
    SUCCEEDED = "Succeeded"    # the pods were deleted (the reconcile recreates them)
    RESOLVED = "Resolved"      # ... and the server made progress again afterwards: the stall did not persist
    FAILED = "Failed"          # the API refused; see the message
    RECOVERED = "Recovered"    # progress resumed during the drain; nothing was deleted
    DRY_RUN = "DryRun"         # mode DryRun: what would have been done
    HALTED = "Halted"          # the escalation stopped remediation of the fleet

    @property
    def spends_budget(self) -> bool:
        """A restart with this outcome counts against budgetPerHour (dry runs and recoveries are free)."""
        return self in (Outcome.PENDING, Outcome.SUCCEEDED, Outcome.RESOLVED, Outcome.FAILED)

    @property
    def unresolved(self) -> bool:
        """A restart with this outcome may still be underway, and pushes the ladder up."""
        return self in (Outcome.PENDING, Outcome.SUCCEEDED)

    @property
    def event(self) -> tuple[str, str]:
        """(type, reason) of the Event that reports a carried-out action ending this way."""
        return {Outcome.SUCCEEDED: ("Normal", "Remediated"), Outcome.RECOVERED: ("Normal", "RemediationCancelled"),
                Outcome.FAILED: ("Warning", "RemediationFailed")}.get(self, ("Warning", "Remediation"))


class Choice(str, enum.Enum):
    """What the policy chose for one stalled server."""
    ACT = "Act"
    DRY_RUN = "DryRun"
    SKIP = "Skip"


class SkipReason(str, enum.Enum):
    """Why the policy chose to do nothing about a stalled server (the rules of docs/remediation.md)."""
    HALTED = "Halted"
    IN_PROGRESS = "InProgress"
    COOLDOWN = "Cooldown"
    BUDGET_EXHAUSTED = "BudgetExhausted"
    CONCURRENCY_LIMIT = "ConcurrencyLimit"
    LAST_READY_SERVER = "LastReadyServer"


class ConditionType(enum.StrEnum):
    """`status.conditions[].type`. A StrEnum (as `Reason`): the members go into status dicts, Events
    and log lines as they are."""
    READY = "Ready"              # the fleet serves: every role has a Ready server, and so does the router
    PROGRESSING = "Progressing"  # it is moving towards its spec
    DEGRADED = "Degraded"        # something needs a person (or time)
    STALLED = "Stalled"          # a server has work and makes no progress
    REMEDIATING = "Remediating"  # a restart is underway


# Who writes which condition: the reconcile pass computes these (decisions/conditions.py) ...
RECONCILE_CONDITIONS = (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.DEGRADED)
# ... and lays the stall controller's over them (decisions/stall_status.py), which may also set Degraded.
STALL_CONDITIONS = (ConditionType.STALLED, ConditionType.REMEDIATING)


class Reason(enum.StrEnum):
    """Condition and Event reasons said in more than one place (the others are spelled where they are made)."""
    INVALID_SPEC = "InvalidSpec"                     # Ready, Progressing: the spec cannot be used (and Degraded)
    BUDGET_EXHAUSTED = "RemediationBudgetExhausted"  # Degraded, Remediating, and the Event of the skip
    REMEDIATION_HALTED = "RemediationHalted"         # Degraded, and the Event of the escalation's Halt


class RemediationMode(str, enum.Enum):
    """`spec.remediation.mode`."""
    AUTO = "Auto"          # drain and restart stalled servers
    DRY_RUN = "DryRun"     # detect and report only
    DISABLED = "Disabled"  # do not watch for stalls


class ScaleReason(str, enum.Enum):
    """Why a role's desired server count changed (`status.<role>.lastScale.reason`, Events, metrics)."""
    WAITING = "WaitingAboveTarget"            # requests waiting per rank above the target
    KV_CACHE = "KVCacheAboveTarget"           # KV-cache use per rank above the target
    TTFT = "TimeToFirstTokenAboveTarget"      # mean time to first token above the target
    ITL = "InterTokenLatencyAboveTarget"      # mean inter-token latency above the target
    GENERATION_BACKLOG = "GenerationBacklog"  # context servers hold KV the generation role does not pull fast enough
    BELOW_TARGETS = "BelowTargets"            # every signal would stay under its target with fewer servers
    BELOW_MINIMUM = "BelowMinimum"            # raised to autoscaling.minServers
    ABOVE_MAXIMUM = "AboveMaximum"            # lowered to autoscaling.maxServers
    SPEC_CHANGED = "SpecChanged"              # the fleet's spec.<role>.servers changed
    SCALED_EXTERNALLY = "ScaledExternally"    # kubectl scale, an HPA, KEDA: the InferenceFleetRole's replicas
