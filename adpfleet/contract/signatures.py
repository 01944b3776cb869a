"""The stall signatures (docs/remediation.md): the operator's detection records one on every stalled
verdict, its CRD enums and Events carry them, and the local cluster's synthetic servers are told by
these words which one to show.
"""

from __future__ import annotations

import enum


class Signature(str, enum.Enum):
    """How a stalled server makes no progress (docs/remediation.md has the metrics of each)."""
    VETOED = "vetoed"      # the loop spins, the can_queue vote vetoes every forward (a rank starves)
    HUNG = "hung"          # no engine step: a frozen rank (and, in lockstep, every peer it blocks)
    TRANSFER = "transfer"  # KV held for transfers that never complete
