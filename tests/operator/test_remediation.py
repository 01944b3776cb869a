"""The remediation policy as a specification: action = policy(verdict, history, spec, now)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from adpfleet.operator.decisions.detection import StallVerdict
from adpfleet.operator.decisions.history import (Remediation, budget_used, history_from_status, left_drained,
                                                 pending, resolved, restart_deadline, restarts_in_progress,
                                                 still_to_delete, with_records)
from adpfleet.operator.decisions.observed import ServerView
from adpfleet.operator.decisions.remediation import decide
from adpfleet.operator.decisions.stall_status import degraded_problem, overlay, stall_conditions
from adpfleet.operator.resource.vocabulary import Action, Choice, Outcome, ServerState, Signature
from adpfleet.operator.resource.models import FleetSpec
from budgets import examples

NOW = 1_700_000_000.0


def spec(**remediation) -> FleetSpec:
    base = {"mode": "Auto", "cooldownSeconds": 60, "maxConcurrentPerRole": 1, "budgetPerHour": 6}
    base.update(remediation)
    return FleetSpec.model_validate({
        "image": "adpfleet:dev", "model": {"name": "tiny"},
        "context": {"servers": 2}, "generation": {"servers": 2},
        "monitoring": {"scrapeIntervalSeconds": 1}, "remediation": {"stallWindowSeconds": 10, **base}})


def fleet(ready=True, created=NOW - 10, **overrides) -> list[ServerView]:
    """Two servers per role, Ready, their pods created `created` (by default after every record the
    tests write, i.e. any earlier restart has finished)."""
    servers = {n: ServerView(n, n.split("-")[1], ready, created=created)
               for n in ("f-context-0", "f-context-1", "f-generation-0", "f-generation-1")}
    for name, view in overrides.items():
        servers[name.replace("_", "-")] = view
    return [v for v in servers.values() if v is not None]


def stalled(server="f-context-0", signature=Signature.VETOED, ranks=(1,)) -> StallVerdict:
    role = server.split("-")[1]
    return StallVerdict(server, role, ServerState.STALLED, NOW, "no real tokens for 10 s while having work",
                        signature=signature, ranks=ranks, since=NOW - 10,
                        evidence={"real_tokens_delta": 0, "empty_batch_iterations_delta": {"0": 0, "1": 500}})


def record(server="f-context-0", ago=30.0, action=Action.RESTART_SERVER, outcome=Outcome.SUCCEEDED,
           targets=None) -> Remediation:
    return Remediation(time=NOW - ago, role=server.split("-")[1], server=server, signature=Signature.VETOED,
                       action=action, outcome=outcome, message="", targets=targets or (server,))


def only(plan):
    assert len(plan.decisions) == 1, plan.decisions
    return plan.decisions[0]


# ---- the first action --------------------------------------------------------------------------

def test_a_stalled_server_is_drained_and_restarted_with_its_evidence():
    d = only(decide([stalled()], [], spec(), fleet(), NOW))
    assert (d.choice, d.action, d.targets, d.level) == (Choice.ACT, Action.RESTART_SERVER, ("f-context-0",), 0)
    assert "empty_batch_iterations_delta=r0:0/r1:500" in d.message and "[vetoed, ranks 1]" in d.message
    rec = d.record(NOW)
    assert (rec.action, rec.outcome, rec.targets, rec.signature) == ("RestartServer", "Pending", ("f-context-0",),
                                                                     "vetoed")
    assert d.event_reason == "RestartingServer"


def test_servers_that_are_not_stalled_get_no_decision():
    suspect = StallVerdict("f-context-0", "context", ServerState.SUSPECT, NOW, "not yet confirmed")
    unreachable = StallVerdict("f-context-1", "context", ServerState.UNREACHABLE, NOW, "timed out")
    idle = StallVerdict("f-generation-0", "generation", ServerState.IDLE, NOW, "no work")
    assert decide([suspect, unreachable, idle], [], spec(), fleet(), NOW).decisions == ()


def test_disabled_decides_nothing():
    plan = decide([stalled()], [], spec(mode="Disabled"), fleet(), NOW)
    assert plan.decisions == () and plan.mode == "Disabled"


def test_dry_run_records_what_would_be_done_and_does_nothing():
    d = only(decide([stalled()], [], spec(mode="DryRun"), fleet(), NOW))
    assert d.choice is Choice.DRY_RUN and d.message.startswith("would RestartServer f-context-0")
    assert d.record(NOW).outcome == "DryRun" and d.event_reason == "RemediationDryRun"


def test_dry_run_repeats_only_after_the_cooldown_and_says_nothing_in_between():
    history = [record(outcome=Outcome.DRY_RUN, ago=10)]
    d = only(decide([stalled()], history, spec(mode="DryRun"), fleet(), NOW))
    assert (d.reason, d.quiet) == ("Cooldown", True)  # reported once: no RemediationSkipped after each dry run
    history = [record(outcome=Outcome.DRY_RUN, ago=61)]
    assert only(decide([stalled()], history, spec(mode="DryRun"), fleet(), NOW)).choice is Choice.DRY_RUN


def test_a_dry_run_is_not_a_remediation_once_the_mode_is_auto():
    # DryRun → Auto: what was only reported cools nothing down, counts no budget, climbs no ladder
    history = [record(outcome=Outcome.DRY_RUN, ago=10), record(outcome=Outcome.DRY_RUN, ago=130)]
    d = only(decide([stalled()], history, spec(mode="Auto", cooldownSeconds=300), fleet(), NOW))
    assert (d.choice, d.action, d.level) == (Choice.ACT, Action.RESTART_SERVER, 0)
    # a real remediation still cools down, and says so
    d = only(decide([stalled()], [record(ago=10)], spec(cooldownSeconds=300), fleet(), NOW))
    assert (d.reason, d.quiet) == ("Cooldown", False)


def test_zero_budget_behaves_like_dry_run():
    assert only(decide([stalled()], [], spec(budgetPerHour=0), fleet(), NOW)).choice is Choice.DRY_RUN


# ---- no duplicates: cooldown and in-progress from the history ----------------------------------

def test_cooldown_per_server():
    history = [record(ago=30)]
    skipped = only(decide([stalled()], history, spec(cooldownSeconds=60), fleet(), NOW))
    # the plain word, as Events ("not remediated (Cooldown)") and metric labels print it
    assert skipped.reason == "Cooldown" and f"{skipped.reason}" == "Cooldown" and type(skipped.reason) is str
    other = decide([stalled("f-context-1")], history, spec(cooldownSeconds=60), fleet(), NOW)
    assert only(other).choice is Choice.ACT  # another server is not cooled down


def test_cooldown_also_covers_a_server_restarted_as_a_peer_of_another():
    # f-context-0's stall restarted both generation servers 30 s ago; they are back and Ready
    peers = record("f-context-0", ago=30, action=Action.RESTART_PEERS,
                   targets=("f-generation-0", "f-generation-1"))
    d = only(decide([stalled("f-generation-0")], [peers], spec(cooldownSeconds=60), fleet(), NOW))
    assert (d.choice, d.reason) == (Choice.SKIP, "Cooldown") and "f-generation-0 was remediated 30 s ago" in d.message
    later = only(decide([stalled("f-generation-0")], [peers], spec(cooldownSeconds=60), fleet(), NOW + 31))
    assert later.choice is Choice.ACT


def test_a_pending_restart_is_never_repeated_by_a_restarted_operator():
    # the operator recorded the decision, then died before (or while) deleting the pod
    history = history_from_status({"recentRemediations": [record(ago=5, outcome=Outcome.PENDING).to_status()]})
    d = only(decide([stalled()], history, spec(cooldownSeconds=0), fleet(), NOW))
    assert (d.choice, d.reason, d.quiet) == (Choice.SKIP, "InProgress", True)


def test_a_restart_is_in_progress_until_a_new_pod_is_ready():
    rec = record(ago=20)
    old_pod = fleet(created=NOW - 3600)
    assert "f-context-0" in restarts_in_progress([rec], old_pod, spec(), NOW)  # the old pod is still there
    new_not_ready = fleet(f_context_0=ServerView("f-context-0", "context", False, created=NOW - 15))
    assert "f-context-0" in restarts_in_progress([rec], new_not_ready, spec(), NOW)
    new_ready = fleet(f_context_0=ServerView("f-context-0", "context", True, created=NOW - 15))
    assert restarts_in_progress([rec], new_ready, spec(), NOW) == {}
    gone = fleet(f_context_0=None)
    assert "f-context-0" in restarts_in_progress([rec], gone, spec(), NOW)


def test_a_restart_that_never_comes_back_stops_blocking_after_the_timeouts():
    rec = record(ago=10_000)
    assert restarts_in_progress([rec], fleet(f_context_0=None), spec(), NOW) == {}


def test_carrying_out_a_pending_record_never_deletes_the_replacement():
    rec = record(ago=5, outcome=Outcome.PENDING)
    assert still_to_delete(rec, NOW - 3600)
    assert not still_to_delete(rec, NOW - 1)
    assert not still_to_delete(rec, None)


def test_a_pod_created_in_the_decisions_own_second_is_the_replacement():
    # creationTimestamp has whole seconds: a pod stamped with the decision's second was created
    # after it (a stalled pod is at least a window old), so it is never deleted
    rec = Remediation(time=NOW + 0.7, role="context", server="f-context-0", signature=Signature.VETOED,
                      action=Action.RESTART_SERVER, outcome=Outcome.PENDING, targets=("f-context-0",))
    assert not still_to_delete(rec, NOW)
    assert still_to_delete(rec, NOW - 1)


def test_a_restarted_operator_finishes_pending_records_until_their_restart_deadline():
    s = spec(drainTimeoutSeconds=30)  # startup 600 s by default: the deadline is 30 + 600 + 60 s
    fresh, stale = record(ago=100, outcome=Outcome.PENDING), record("f-context-1", ago=700, outcome=Outcome.PENDING)
    done = record("f-generation-0", ago=100)
    assert pending([fresh, stale, done], s, NOW) == ([fresh], [stale])


def test_the_restart_deadline_uses_the_roles_startup_and_the_longest_for_an_unknown_role():
    s = FleetSpec.model_validate({"image": "x", "model": {"name": "tiny"},
                                  "context": {"probes": {"startupTimeoutSeconds": 100}},
                                  "generation": {"probes": {"startupTimeoutSeconds": 900}},
                                  "remediation": {"drainTimeoutSeconds": 10}})
    rec = record(ago=0)
    assert restart_deadline(rec, s, "context") == NOW + 10 + 100 + 60
    assert restart_deadline(rec, s, "generation") == NOW + 10 + 900 + 60
    assert restart_deadline(rec, s) == restart_deadline(rec, s, "aggregated") == NOW + 10 + 900 + 60


def test_a_server_left_drained_by_a_recovered_action_is_undrained():
    recovered = record(ago=30, outcome=Outcome.RECOVERED)
    drained = fleet(created=NOW - 3600, f_context_0=ServerView("f-context-0", "context", True, created=NOW - 3600,
                                                               draining=True))
    assert left_drained([recovered], drained, NOW) == ["f-context-0"]
    assert left_drained([record(ago=30, outcome=Outcome.PENDING)], drained, NOW) == []  # still being restarted
    replaced = fleet(f_context_0=ServerView("f-context-0", "context", True, created=NOW - 1, draining=True))
    assert left_drained([recovered], replaced, NOW) == []  # a new pod: drained for another reason
    assert left_drained([record(ago=7200, outcome=Outcome.RECOVERED)], drained, NOW) == []


# ---- escalation ---------------------------------------------------------------------------------

def test_a_stall_that_persists_after_the_restart_restarts_the_peers():
    history = [record(ago=120)]
    d = only(decide([stalled()], history, spec(), fleet(), NOW))
    assert (d.action, d.targets, d.level) == (Action.RESTART_PEERS, ("f-generation-0", "f-generation-1"), 1)
    # rolling, one at a time, so a Ready generation server remains at every step
    assert (d.choice, d.rolling, d.batch, d.event_reason) == (Choice.ACT, True, 1, "RestartingPeers")
    d = only(decide([stalled()], history, spec(maxConcurrentPerRole=2), fleet(), NOW))
    assert d.batch == 1  # two at once would leave no Ready generation server
    busy = [record("f-generation-1", ago=5, outcome=Outcome.PENDING)] + history
    assert only(decide([stalled()], busy, spec(), fleet(), NOW)).reason == "ConcurrencyLimit"


def test_a_restart_after_which_the_server_made_progress_is_resolved_and_a_new_stall_starts_over():
    history = [record(ago=120)]
    progressing = StallVerdict("f-context-0", "context", ServerState.PROGRESSING, NOW, "tokens")
    done = resolved(history, [progressing], fleet(created=NOW - 100))
    assert [r.outcome for r in done] == ["Resolved"]
    assert resolved(history, [progressing], fleet(created=NOW - 3600)) == []  # still the old pod
    assert resolved(history, [stalled()], fleet()) == []
    d = only(decide([stalled()], done, spec(), fleet(), NOW))
    assert (d.action, d.level) == (Action.RESTART_SERVER, 0)
    assert budget_used(done, NOW) == 1  # it still cost budget


def test_a_generation_server_waiting_on_transfers_escalates_to_the_context_servers():
    history = [record("f-generation-0", ago=120)]
    d = only(decide([stalled("f-generation-0", Signature.TRANSFER, (0,))], history, spec(maxConcurrentPerRole=2),
                    fleet(), NOW))
    assert (d.action, d.targets) == (Action.RESTART_PEERS, ("f-context-0", "f-context-1"))


def test_escalation_halts_after_too_many_remediations():
    history = [record(ago=a) for a in (100, 200, 300)]
    plan = decide([stalled()], history, spec(escalation={"afterRemediations": 3, "action": "Halt"}), fleet(), NOW)
    d = only(plan)
    assert d.action is Action.HALT and d.choice is Choice.ACT and plan.halted
    assert d.record(NOW).outcome == "Halted"
    assert degraded_problem(plan)[0] == "RemediationHalted"
    later = decide([stalled("f-context-1")], [d.record(NOW)] + history, spec(), fleet(), NOW + 10)
    assert only(later).reason == "Halted"


def test_a_halt_older_than_the_escalation_window_lets_remediation_resume():
    halt = Remediation(time=NOW - 3601, role="context", server="f-context-0", signature=Signature.VETOED,
                       action=Action.HALT, outcome=Outcome.HALTED)
    plan = decide([stalled("f-context-1")], [halt], spec(escalation={"windowSeconds": 3600}), fleet(), NOW)
    assert only(plan).choice is Choice.ACT and not plan.halted
    recent = decide([stalled("f-context-1")], [halt], spec(escalation={"windowSeconds": 3600}), fleet(), NOW - 2)
    assert only(recent).reason == "Halted" and recent.halted


def test_escalation_can_restart_the_whole_role():
    history = [record(ago=a) for a in (100, 200, 300)]
    d = only(decide([stalled()], history, spec(escalation={"afterRemediations": 3, "action": "RestartRole"}),
                    fleet(), NOW))
    assert (d.action, d.targets, d.choice, d.batch) == (Action.RESTART_ROLE, ("f-context-0", "f-context-1"),
                                                         Choice.ACT, 1)


def test_servers_waiting_for_their_model_are_never_restarted_as_peers_or_with_the_role():
    # f-generation-1 has never been Ready: its model is still downloading (or cannot be had)
    waiting = ServerView("f-generation-1", "generation", False, created=NOW - 10, waiting_for_model=True)
    d = only(decide([stalled()], [record(ago=120)], spec(), fleet(f_generation_1=waiting), NOW))
    assert (d.action, d.targets) == (Action.RESTART_PEERS, ("f-generation-0",))
    history = [record("f-generation-0", ago=a) for a in (100, 200, 300)]
    d = only(decide([stalled("f-generation-0")], history, spec(escalation={"afterRemediations": 3,
                                                                           "action": "RestartRole"}),
                    fleet(f_generation_1=waiting), NOW))
    assert (d.action, d.targets) == (Action.RESTART_ROLE, ("f-generation-0",))


def test_old_remediations_fall_out_of_the_escalation_window():
    history = [record(ago=a) for a in (4000, 5000, 6000)]
    d = only(decide([stalled()], history, spec(escalation={"windowSeconds": 3600}), fleet(), NOW))
    assert d.action is Action.RESTART_SERVER and d.level == 0


# ---- budget, concurrency, last ready server ------------------------------------------------------

def test_budget_per_hour_then_degraded_and_events_only():
    history = [record(f"f-context-{i % 2}", ago=600 + i, outcome=Outcome.SUCCEEDED) for i in range(3)]
    plan = decide([stalled("f-generation-0")], history, spec(budgetPerHour=3), fleet(), NOW)
    d = only(plan)
    assert (d.choice, d.reason, d.event_reason) == (Choice.SKIP, "BudgetExhausted", "RemediationBudgetExhausted")
    assert d.record(NOW) is None  # events only
    assert plan.budget_exhausted and degraded_problem(plan)[0] == "RemediationBudgetExhausted"
    # an hour later the budget is back
    assert only(decide([stalled("f-generation-0")], history, spec(budgetPerHour=3), fleet(), NOW + 3600)).choice \
        is Choice.ACT


def test_failed_actions_spend_budget_and_dry_runs_do_not():
    failed = [record(f"f-context-{i % 2}", ago=600 + i, outcome=Outcome.FAILED) for i in range(2)]
    assert budget_used(failed, NOW) == 2
    assert only(decide([stalled("f-generation-0")], failed, spec(budgetPerHour=2), fleet(), NOW)).reason == \
        "BudgetExhausted"
    assert budget_used([record(outcome=Outcome.DRY_RUN), record(outcome=Outcome.RECOVERED)], NOW) == 0


def test_budget_counts_actions_decided_in_the_same_pass():
    plan = decide([stalled("f-context-0"), stalled("f-generation-0")], [], spec(budgetPerHour=1), fleet(), NOW)
    assert [d.choice for d in plan.decisions] == [Choice.ACT, Choice.SKIP]


def test_at_most_k_servers_of_a_role_at_once():
    plan = decide([stalled("f-context-0"), stalled("f-context-1")], [], spec(maxConcurrentPerRole=1), fleet(), NOW)
    assert [(d.verdict.server, d.choice, d.reason) for d in plan.decisions] == [
        ("f-context-0", Choice.ACT, "RestartServer"), ("f-context-1", Choice.SKIP, "ConcurrencyLimit")]
    busy = [record("f-context-1", ago=5, outcome=Outcome.PENDING)]
    assert only(decide([stalled("f-context-0")], busy, spec(), fleet(), NOW)).reason == "ConcurrencyLimit"


def test_never_the_last_ready_server_of_a_role_unless_the_whole_role_is_stalled():
    one_ready = fleet(f_context_1=ServerView("f-context-1", "context", ready=False, created=NOW))
    d = only(decide([stalled("f-context-0")], [], spec(), one_ready, NOW))
    assert (d.choice, d.reason) == (Choice.SKIP, "LastReadyServer")
    both = decide([stalled("f-context-0"), stalled("f-context-1")], [], spec(maxConcurrentPerRole=2), fleet(), NOW)
    assert [d.choice for d in both.decisions] == [Choice.ACT, Choice.ACT]


def test_a_rolling_peer_restart_never_takes_the_peer_roles_last_ready_server():
    # the stall persisted after f-context-0's own restart: its peers are next, but only one
    # generation server is Ready and the generation role is not stalled
    one_ready = fleet(f_generation_1=ServerView("f-generation-1", "generation", ready=False, created=NOW - 10))
    d = only(decide([stalled()], [record(ago=120)], spec(maxConcurrentPerRole=2), one_ready, NOW))
    assert (d.action, d.choice, d.reason) == (Action.RESTART_PEERS, Choice.SKIP, "LastReadyServer")
    assert "would leave no Ready generation server" in d.message


def test_a_single_server_role_that_is_stalled_is_restarted():
    servers = [ServerView("f-context-0", "context", True), ServerView("f-generation-0", "generation", True)]
    assert only(decide([stalled()], [], spec(), servers, NOW)).choice is Choice.ACT


def test_peers_of_a_wholly_stalled_role_may_be_restarted_even_the_last_ready_one():
    servers = [ServerView("f-context-0", "context", True), ServerView("f-generation-0", "generation", True)]
    d = only(decide([stalled()], [record(ago=120)], spec(), servers, NOW))
    assert (d.action, d.targets, d.choice) == (Action.RESTART_PEERS, ("f-generation-0",), Choice.ACT)


# ---- the history in status ----------------------------------------------------------------------

def test_history_round_trips_through_status_and_stays_bounded():
    records = [record(ago=float(i)) for i in range(30)]
    history = with_records([], records)
    assert len(history) == 20 and history[0].time == NOW
    back = history_from_status({"recentRemediations": [r.to_status() for r in history]})
    assert [(r.time, r.server, r.targets) for r in back] == [(pytest_approx(r.time), r.server, r.targets)
                                                             for r in history]
    updated = with_records(back, [back[0].__class__(**{**back[0].__dict__, "outcome": "Succeeded"})])
    assert len(updated) == 20 and updated[0].outcome == "Succeeded"


def test_a_full_history_keeps_the_last_hours_actions_before_dry_runs():
    actions = [record(f"f-context-{i % 2}", ago=3000 - i) for i in range(5)]
    dry = [record("f-generation-0", ago=float(i), outcome=Outcome.DRY_RUN) for i in range(30)]
    history = with_records(actions, dry)
    assert len(history) == 20 and sum(r.outcome == "Succeeded" for r in history) == 5
    assert decide([stalled("f-generation-1")], history, spec(budgetPerHour=5), fleet(), NOW).budget_exhausted


def test_budgets_above_the_history_size_act_as_its_size():
    history = with_records([], [record(f"f-context-{i % 2}", ago=100 + i) for i in range(25)])
    plan = decide([stalled("f-generation-0")], history, spec(budgetPerHour=100), fleet(), NOW)
    assert plan.budget == 20 and plan.budget_exhausted


def pytest_approx(x):
    import pytest
    return pytest.approx(x, abs=1e-3)


def test_unreadable_history_entries_are_ignored():
    assert history_from_status({"recentRemediations": [{"server": "x"}, {"time": "garbage", "role": "context",
                                                                         "server": "x", "action": "A",
                                                                         "outcome": "B"}]}) == []


def test_old_status_records_without_targets_target_their_server():
    entry = record().to_status()
    del entry["targets"]
    assert history_from_status({"recentRemediations": [entry]})[0].targets == ("f-context-0",)


# ---- conditions -----------------------------------------------------------------------------------

def test_conditions_stalled_and_remediating():
    plan = decide([stalled()], [], spec(), fleet(), NOW)
    stalled_c, remediating = stall_conditions([stalled()], plan, {}, 3, "2024-01-01T00:00:00Z")
    assert (stalled_c["type"], stalled_c["status"], stalled_c["reason"]) == ("Stalled", "True", "NoProgress")
    assert "[vetoed]" in stalled_c["message"] and stalled_c["observedGeneration"] == 3
    assert (remediating["status"], remediating["reason"]) == ("True", "Restarting")
    calm = decide([], [], spec(), fleet(), NOW)
    previous = {c["type"]: c for c in (stalled_c, remediating)}
    s2, r2 = stall_conditions([], calm, previous, 3, "2024-01-01T00:01:00Z")
    assert (s2["status"], r2["status"]) == ("False", "False") and s2["lastTransitionTime"] == "2024-01-01T00:01:00Z"


def test_remediations_degraded_reason_shows_unless_the_reconcile_reports_a_problem_of_its_own():
    halted = decide([stalled()], [record(ago=a) for a in (100, 200, 300)],
                    spec(escalation={"afterRemediations": 3, "action": "Halt"}), fleet(), NOW)
    now = "2024-01-01T00:00:00Z"

    def status(degraded: str, reason: str) -> dict:
        return {"observedGeneration": 2, "conditions": [
            {"type": "Degraded", "status": degraded, "reason": reason, "message": "", "lastTransitionTime": now,
             "observedGeneration": 2}]}
    fine = overlay(status("False", "AsExpected"), {}, [stalled()], halted, [], now, generation=2)
    conditions = {c["type"]: c for c in fine["conditions"]}
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == ("True", "RemediationHalted")
    assert conditions["Stalled"]["status"] == "True" and "recentRemediations" not in fine
    own = overlay(status("True", "SecretNotFound"), {}, [stalled()], halted, [record()], now, generation=2)
    assert {c["type"]: c["reason"] for c in own["conditions"]}["Degraded"] == "SecretNotFound"
    assert own["recentRemediations"] == [record().to_status()]


# ---- properties -----------------------------------------------------------------------------------

SERVERS = ("f-context-0", "f-context-1", "f-generation-0", "f-generation-1")


def _past(name: str, action: Action, outcome: Outcome, ago: float) -> Remediation:
    """A history record as `decide` could have written it: targets follow the action."""
    role = name.split("-")[1]
    own = tuple(s for s in SERVERS if role in s)
    peers = tuple(s for s in SERVERS if role not in s)
    targets = {Action.RESTART_SERVER: (name,), Action.RESTART_PEERS: peers, Action.RESTART_ROLE: own,
               Action.HALT: ()}[action]
    return Remediation(time=NOW - ago, role=role, server=name, signature=Signature.VETOED, action=action,
                       outcome=Outcome.HALTED if action is Action.HALT else outcome, targets=targets)


@settings(max_examples=examples(400), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(SERVERS), st.sampled_from(list(Action)),
                          st.sampled_from([o for o in Outcome if o is not Outcome.HALTED]), st.floats(1, 5000)),
                max_size=12),
       st.lists(st.sampled_from(SERVERS), unique=True),
       st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()),
       st.sampled_from([NOW - 10, NOW - 6000]),
       st.integers(1, 3), st.integers(0, 8), st.sampled_from(["Auto", "DryRun"]),
       st.sampled_from(["Halt", "RestartRole"]), st.integers(1, 3))
def test_policy_invariants(past, stalled_now, ready, created, k, budget, mode, escalate, after):
    """Whatever happened before (restarts of servers, peers and roles with any outcome, halts),
    however many servers are Ready: never more than the budget per hour, never more than K servers
    of a role at once, never a server twice in one plan, never a server in cooldown, nothing while
    a recent Halt stands, and never a role's last Ready server unless its stall excuses it."""
    s = spec(maxConcurrentPerRole=k, budgetPerHour=budget, mode=mode, cooldownSeconds=300,
             escalation={"action": escalate, "afterRemediations": after})
    history = with_records([], [_past(*p) for p in past])
    servers = [ServerView(n, n.split("-")[1], r, created=created) for n, r in zip(SERVERS, ready)]
    plan = decide([stalled(n) for n in stalled_now], history, s, servers, NOW)
    acted = [d for d in plan.actions if d.action is not Action.HALT]
    assert plan.budget_used + len(acted) <= max(plan.budget, plan.budget_used)
    targets = [t for d in acted for t in d.targets]
    assert len(targets) == len(set(targets))
    first_batches = [t for d in acted for t in (d.targets[:d.batch] if d.rolling else d.targets)]
    for role in ("context", "generation"):
        busy = [n for n in plan.in_progress if role in n]
        assert len(busy) + sum(role in t for t in first_batches) <= max(k, len(busy))
    for d in acted:
        assert not any((d.verdict.server == r.server or d.verdict.server in r.targets) and NOW - r.time < 300
                       and r.outcome is not Outcome.DRY_RUN for r in history)  # a dry run cools nothing down
    if mode == "DryRun" or any(r.action == "Halt" and NOW - r.time < 3600 for r in history):
        assert acted == []

    def wholly_stalled(role):
        return all(n in stalled_now for n in SERVERS if role in n)

    def ready_left(role, removed):
        return [v.name for v in servers if v.role == role and v.ready and v.name not in plan.in_progress
                and v.name not in removed]
    for d in acted:
        removed = d.targets[:d.batch] if d.rolling else d.targets
        for role in {t.split("-")[1] for t in removed}:
            excused = wholly_stalled(role) or (role != d.verdict.role and wholly_stalled(d.verdict.role))
            if ready_left(role, ()) and not excused:
                assert ready_left(role, removed), (d, servers)
