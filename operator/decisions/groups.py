"""A server over several pods, seen as one server: the unit the rollout rules, the status counts and
remediation act on.

The pods of server `<fleet>-<role>-<i>` (`<fleet>-<role>-<i>-<j>`, leader j = 0) become one
`ServerPod` named after the leader, with its members kept in `members`. It is Ready only when every
member is. A group that has lost a member is **broken** and shows as a Failed server, so the first
rollout rule deletes all of it and the slot is refilled with a whole new group:
- a member is missing (deleted, evicted, never created) or terminating while the others are not;
- a member finished (Failed/Succeeded);
- a member's container restarted.
Never mended, because it cannot be: the ranks of the remaining pods were in a collective with the
lost ones (they exit within the collective timeout, and a restarted process would join a group that
no longer exists), and the requests on the lost ranks are gone with their KV (docs/adp.md).
One-pod servers pass through unchanged.
"""

from __future__ import annotations

import dataclasses

from adpfleet.operator.decisions.observed import ServerPod


def servers(pods: list[ServerPod]) -> list[ServerPod]:
    """`pods` (one role's, this fleet's and leftovers alike) with each group folded into one server."""
    out: list[ServerPod] = []
    groups: dict[tuple, list[ServerPod]] = {}
    for pod in pods:
        if pod.pods_per_server == 1:
            out.append(pod)
        else:
            groups.setdefault((pod.owner_uid, pod.index), []).append(pod)
    out += [fold(sorted(members, key=lambda p: p.node_rank)) for members in groups.values()]
    return sorted(out, key=lambda p: p.index)


def fold(members: list[ServerPod]) -> ServerPod:
    leader = next((p for p in members if p.node_rank == 0), None)
    base = leader or members[0]
    members_t = tuple(members)
    live = [p for p in members if not p.terminating]
    if not live:
        return dataclasses.replace(base, terminating=True, ready=False, members=members_t)
    broken = why_broken(members, base.pods_per_server)
    if broken:
        return dataclasses.replace(base, phase="Failed", ready=False, terminating=False, members=members_t,
                                   problem=f"GroupBroken: {broken}; the whole server is recreated")
    problem = next((f"{p.problem} (pod {p.name})" for p in members if p.problem), None)
    return dataclasses.replace(
        base, ready=all(p.ready for p in members), unschedulable=any(p.unschedulable for p in members),
        problem=problem, phase=base.phase if all(p.phase == base.phase for p in members) else "Pending",
        restarts=sum(p.restarts for p in members), members=members_t)


def why_broken(members: list[ServerPod], size: int) -> str | None:
    present = {p.node_rank for p in members if not p.terminating}
    gone = [p.name for p in members if p.terminating]
    if gone:
        return f"pod {', '.join(gone)} is being deleted"
    missing = [j for j in range(size) if j not in present]
    if missing:
        return f"pod{'s' if len(missing) > 1 else ''} of node rank {', '.join(map(str, missing))} missing"
    finished = [p for p in members if p.finished]
    if finished:
        return f"pod {finished[0].name} {finished[0].phase.lower()}"
    restarted = [p for p in members if p.restarts]
    if restarted:
        return f"pod {restarted[0].name} restarted (it cannot rejoin its group)"
    return None
