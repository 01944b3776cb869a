"""The Prometheus text of a server's ranks (contract/metrics.py's families), written in one place for
the runtime's /metrics and the local cluster's synthetic servers, so the two cannot drift apart.

`render(role, ranks)` takes (rank, stats) pairs; a stats object has an attribute per family's
`field` (counters and gauges a number, labeled counters a dict keyed by label values, histograms a
`Histogram`). Every family is written for every rank, so a series exists (at 0) from start-up.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from adpfleet.contract.metrics import (COUNTERS, GAUGES, HISTOGRAMS, LABELED_COUNTERS, NODE_RANK_LABEL, RANK_LABEL,
                                       ROLE_LABEL, Histogram)


def render(role: str, ranks: Sequence[tuple[int, object]], node_rank: int | None = None) -> str:
    """Prometheus text exposition of the given ranks' stats. A server over several pods labels its
    series with the pod's `node_rank` too (0 the leader), so a dashboard names the pod of a rank."""
    pod = ((NODE_RANK_LABEL, node_rank),) if node_rank is not None else ()
    lines: list[str] = []

    def base(rank: int) -> tuple:
        return ((ROLE_LABEL, role), (RANK_LABEL, rank), *pod)

    for f in COUNTERS:
        _family(lines, f.name, "counter", f.help, [(base(r), getattr(s, f.field)) for r, s in ranks])
    for f in LABELED_COUNTERS:
        _family(lines, f.name, "counter", f.help,
                [((*base(r), *zip(f.labels, key if isinstance(key, tuple) else (key,))), n)
                 for r, s in ranks for key, n in sorted(getattr(s, f.field).items())])
    for f in GAUGES:
        _family(lines, f.name, "gauge", f.help, [(base(r), getattr(s, f.field)) for r, s in ranks])
    for f in HISTOGRAMS:
        lines.append(f"# HELP {f.name} {f.help}")
        lines.append(f"# TYPE {f.name} histogram")
        for r, s in ranks:
            _histogram(lines, f.name, _labels(base(r)), getattr(s, f.field))
    return "\n".join(lines) + "\n"


def _family(lines: list[str], name: str, kind: str, help_: str, samples: Iterable[tuple[tuple, float]]) -> None:
    lines.append(f"# HELP {name} {help_}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        lines.append(f"{name}{{{_labels(labels)}}} {float(value)!r}")


def _histogram(lines: list[str], name: str, labels: str, h: Histogram) -> None:
    cumulative = 0
    for bound, n in zip(h.bounds, h.buckets):
        cumulative += n
        lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(cumulative)!r}')
    lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(h.count)!r}')
    lines.append(f"{name}_sum{{{labels}}} {float(h.sum)!r}")
    lines.append(f"{name}_count{{{labels}}} {float(h.count)!r}")


def _labels(pairs: Iterable[tuple[str, object]]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in pairs)
