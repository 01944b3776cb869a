"""Pod addresses: one loopback address per pod (127.N.1.1, 127.N.1.2, ...), so that servers in
different pods can listen on the same port. Linux routes all of 127.0.0.0/8 to `lo`, so binding one
needs no configuration. 127.0.0.x is left to the control plane (127.0.0.1).

N is derived from the cluster's state directory, so two local clusters on one machine (the demo's
and a test session's, say) hand out different addresses instead of fighting over 127.0.1.2:8000."""

from __future__ import annotations

import hashlib
import ipaddress

FIRST = int(ipaddress.IPv4Address("127.0.1.1"))
LAST = int(ipaddress.IPv4Address("127.255.255.254"))


def first_address(state_dir: str | None) -> int:
    """127.N.1.1 with N in 0..254 from the state directory (127.0.1.1 without one)."""
    if not state_dir:
        return FIRST
    n = int.from_bytes(hashlib.sha256(str(state_dir).encode()).digest()[:2], "big") % 255
    return int(ipaddress.IPv4Address(f"127.{n}.1.1"))


class AddressPool:
    def __init__(self, state_dir: str | None = None) -> None:
        self._by_pod: dict[str, str] = {}
        self._next = first_address(state_dir)

    def allocate(self, pod_uid: str, preferred: str | None = None) -> str:
        """The pod's address: the one it already has (after an agent restart), else a free one."""
        if pod_uid in self._by_pod:
            return self._by_pod[pod_uid]
        used = set(self._by_pod.values())
        if preferred and preferred not in used:
            self._by_pod[pod_uid] = preferred
            return preferred
        for _ in range(LAST - FIRST):
            candidate = self._next
            self._next = FIRST if self._next >= LAST else self._next + 1
            address = str(ipaddress.IPv4Address(candidate))
            # Skip network and broadcast-looking addresses: some tools refuse x.y.z.0 and x.y.z.255.
            if candidate & 0xFF in (0, 255) or address in used:
                continue
            self._by_pod[pod_uid] = address
            return address
        raise RuntimeError("no free loopback address left for pods")

    def release(self, pod_uid: str) -> None:
        self._by_pod.pop(pod_uid, None)
