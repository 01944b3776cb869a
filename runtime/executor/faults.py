"""Deliberate faults, to make stalls on purpose in tests and the demo. Off unless the server was
started with `--fault-injection` (or ADPFLEET_FAULT_INJECTION=1 in its environment); then `POST /faults {"kind": ..., "rank": R}` applies one:

  freeze        the rank stops stepping: its peers block in the next collective, every rank's
                iterations stop advancing (the `hung` signature) until the collective timeout
  stop-reaping  a context rank never frees KV that was pulled: held blocks pile up until nothing
                fits (the `transfer` signature)
  starve        the rank admits nothing; its requests wait forever, and with
                `--no-pad-empty-batch` every pass of the fleet is vetoed (the `vetoed` signature)
"""

from __future__ import annotations

KINDS = ("freeze", "stop-reaping", "starve")


def apply(kind: str, engine) -> None:
    """Apply a fault to a rank's engine (`freeze` is handled by the rank loop itself)."""
    if kind == "stop-reaping":
        if engine.kv_hold is None:
            raise ValueError("stop-reaping needs a context server (its ranks hold KV for transfers)")
        engine.kv_hold.reap = lambda: []
    elif kind == "starve":
        engine.scheduler.capacity.admit = lambda waiting: []
    elif kind != "freeze":
        raise ValueError(f"unknown fault {kind!r}; one of {', '.join(KINDS)}")
