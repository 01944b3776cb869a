"""Kubernetes resource quantities ("500m", "8Gi", "1e3"): the pattern the CRD enforces and the parser
the operator's checks and the local node's scheduler both use."""

from __future__ import annotations

import re
from decimal import Decimal

# Kubernetes' own quantity grammar, without the sign (the API server refuses negative requests,
# capacities and limits, so none reaches a parser here).
PATTERN = (r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
           r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
# The same grammar with its optional sign, as the API server's own schemas check quantities (pod templates).
SIGNED_PATTERN = "^[+-]?" + PATTERN[1:]
_RE = re.compile(PATTERN)
_NUMBER = re.compile(r"^[0-9.]+")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
            "P": Decimal("1e15"), "E": Decimal("1e18")}


def parse(value: str | int) -> Decimal:
    """The quantity's value in base units (exact: "0.1" stays 1/10); ValueError names the text when it
    is not a quantity. An int is taken as it is (a manifest written by hand may say `pods: 10`)."""
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text is None or not _RE.match(text):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. '500m', '2', '8Gi')")
    number = _NUMBER.match(text).group(0)
    suffix = text[len(number):]
    if suffix in _BINARY:
        return Decimal(number) * _BINARY[suffix]
    if suffix in _DECIMAL:
        return Decimal(number) * _DECIMAL[suffix]
    return Decimal(number + suffix)  # an exponent: 1e3, 2.5E-1
