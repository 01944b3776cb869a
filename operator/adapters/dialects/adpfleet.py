"""adpfleet's own exposition (adpfleet/contract/metrics.py): one series per family per rank, keyed
by the `rank` label; every server exports every required family for every rank from start-up, so a
rank without one is a text that is not an adpfleet server's, and nothing is unknown."""

from __future__ import annotations

from adpfleet.contract import metrics
from adpfleet.contract.metrics import RankSample
from adpfleet.operator.adapters.dialects.exposition import SampleReader, ScrapeError, per_rank

ENGINE = "adpfleet"
LOCKSTEP = True  # ADP ranks step together: a server's progress is its ranks' together (docs/adp.md)

_FIELDS = metrics.read_fields()
_READER = SampleReader(_FIELDS)


def parse(text: str) -> dict[int, RankSample]:
    """Per-rank samples from an adpfleet server's Prometheus text. Raises `ScrapeError` for anything
    that is not a complete adpfleet server exposition (garbage, HTML, truncated, a family missing)."""
    values = per_rank(_READER(text), metrics.RANK_LABEL, _FIELDS, signed=("last_progress_timestamp",))
    if not values:
        raise ScrapeError("no adpfleet_* series: not an adpfleet server (or no rank is alive)")
    for rank, fields in values.items():
        missing = sorted(name for name in metrics.REQUIRED if _FIELDS[name] not in fields)
        if missing:
            raise ScrapeError(f"rank {rank} lacks {', '.join(missing)}")
    return {rank: RankSample(**fields) for rank, fields in sorted(values.items())}
