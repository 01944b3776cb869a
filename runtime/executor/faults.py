"""Deliberate faults, to make stalls on purpose in tests and the demo. Off unless the server was
started with `--fault-injection` (or ADPFLEET_FAULT_INJECTION=1 in its environment); then `POST /faults {"kind": ..., "rank": R}` applies one:

  freeze        the rank stops stepping: its peers block in the next collective, every rank's
                iterations stop advancing (the `hung` signature) until the collective timeout
  stop-reaping  a context rank never frees KV that was pulled: held blocks pile up until nothing
                fits (the `transfer` signature)
  stop-serving-kv  a context rank's KV transfer server takes pulls and never answers them (a wedged
                transfer): the generation servers' pulls time out, the blocks stay held (`transfer`)
  starve        the rank admits nothing; its requests wait forever, and with
                `--no-pad-empty-batch` every pass of the fleet is vetoed (the `vetoed` signature)
"""

from __future__ import annotations

import threading

KINDS = ("freeze", "stop-reaping", "stop-serving-kv", "starve")
CONTEXT_ONLY = ("stop-reaping", "stop-serving-kv")  # faults of the KV a context server holds


def apply(kind: str, engine, kv_server=None) -> None:
    """Apply a fault to a rank's engine, or its KV transfer server (`freeze` is handled by the rank
    loop itself)."""
    if kind in CONTEXT_ONLY and (engine.kv_hold is None or kv_server is None):
        raise ValueError(f"{kind} needs a context server (its ranks hold KV for transfers)")
    if kind == "stop-reaping":
        engine.kv_hold.reap = lambda: []
    elif kind == "stop-serving-kv":
        kv_server.lookup = _wedged(kv_server.lookup)
    elif kind == "starve":
        engine.scheduler.capacity.admit = lambda waiting: []
    elif kind != "freeze":
        raise ValueError(f"unknown fault {kind!r}; one of {', '.join(KINDS)}")


def _wedged(lookup):
    """A lookup that finds the held prompt (its transfer has begun) and never returns."""
    stuck = threading.Event()

    def wedged(handle: str):
        lookup(handle)
        stuck.wait()
    return wedged
