"""The fleet's model as its servers show it: `status.model`, what the Progressing condition says
while servers download, and the ModelUnavailable problem (Degraded, and its Event). Pure.

Each server pod says where its model stands (`ServerPod.model`, read from its `fetch-model` init
container and the termination messages of that container and the server's). Download progress is
not in the pod's status: the reconcile pass reads it from the running init container's log (the
progress lines of `adpfleet.model_uri`) and hands it in as `progress`.
"""

from __future__ import annotations

from dataclasses import dataclass

from adpfleet.model_uri import ModelURI, progress_amount
from adpfleet.operator.decisions.conditions import MODEL_UNAVAILABLE, Problem
from adpfleet.operator.decisions.observed import FETCHED, FETCHING, ServerPod

CLAIM_NOT_FOUND = "ClaimNotFound"       # status.model.reason when a claim the model needs does not exist


@dataclass(frozen=True)
class ModelReport:
    status: dict               # status.model
    downloading: str | None    # for the Progressing message: who downloads, how far
    problems: list[Problem]    # ModelUnavailable, one per distinct cause, naming its servers


def model_report(uri: ModelURI, pods: list[ServerPod], progress: dict[str, tuple[int, int]],
                 claim_missing: bool = False) -> ModelReport:
    """`pods`: the fleet's live server pods; `progress`: pod name -> (bytes done, bytes total) of the
    downloads whose log said so; `claim_missing`: a claim the model needs does not exist (the pass
    reports that problem itself: no server is created until it does)."""
    status: dict = {"source": uri.uri}
    causes: dict[tuple[str, str], list[str]] = {}
    for pod in pods:
        if pod.model_failure:
            causes.setdefault(pod.model_failure, []).append(pod.name)
    problems = [Problem(MODEL_UNAVAILABLE, f"{reason}: {message} ({', '.join(servers)})")
                for (reason, message), servers in causes.items()]
    fetching = [p for p in pods if p.model == FETCHING]
    downloading = None
    if claim_missing or causes:
        status.update(phase="Unavailable", reason=CLAIM_NOT_FOUND if claim_missing else next(iter(causes))[0])
    elif fetching and uri.downloads:
        known = [progress[p.name] for p in fetching if p.name in progress]
        status["phase"] = "Downloading"
        if known:
            done, total = sum(d for d, _ in known), sum(t for _, t in known)
            status.update(bytesDone=done, bytesTotal=total, progress=progress_amount(done, total))
        each = [f"{p.name} " + (progress_amount(*progress[p.name]) if p.name in progress else "starting")
                for p in fetching]
        downloading = f"downloading {uri.uri}: {', '.join(each)}"
    elif any(p.ready or p.model == FETCHED for p in pods):
        status["phase"] = "Available"
        revisions = sorted({p.model_revision for p in pods if p.model_revision})
        if revisions:  # more than one: servers with their own caches fetched while a branch moved
            status["revision"] = ", ".join(revisions)
    else:
        status["phase"] = "Pending"
    return ModelReport(status, downloading, problems)
