"""How a server's /metrics are read, per engine: a dialect turns one exposition into the per-rank
samples the detection judges (RankSample, adpfleet/contract/metrics.py), whatever the engine calls things.

    dialect_for("adpfleet" | "vllm") -> Dialect

A new engine is one module here (its `ENGINE`, `LOCKSTEP` and `parse`), one line in DIALECTS, and
its tests on expositions captured from the real server (docs/remediation.md, "Dialects").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from adpfleet.contract.metrics import RankSample
from adpfleet.operator.adapters.dialects import adpfleet, vllm
from adpfleet.operator.adapters.dialects.exposition import ScrapeError  # noqa: F401 - what parse raises


@dataclass(frozen=True)
class Dialect:
    engine: str
    parse: Callable[[str], dict[int, RankSample]]  # raises ScrapeError for a text that is not this engine's
    lockstep: bool  # ranks step together (one verdict for all) or each on its own (each judged alone)


DIALECTS = {d.engine: d for d in (Dialect(m.ENGINE, m.parse, m.LOCKSTEP) for m in (adpfleet, vllm))}
ADPFLEET = DIALECTS[adpfleet.ENGINE]


def dialect_for(engine: str) -> Dialect:
    """The dialect of a role's engine (the InferenceFleet's engine name); ValueError names the known ones."""
    try:
        return DIALECTS[engine]
    except KeyError:
        raise ValueError(f"no metrics dialect for engine {engine!r}: known engines are "
                         f"{', '.join(sorted(DIALECTS))}") from None
