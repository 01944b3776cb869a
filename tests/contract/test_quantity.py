"""Kubernetes quantities, parsed once for the operator's checks and the local node's scheduler."""

from decimal import Decimal

import pytest

from adpfleet.contract import quantity


@pytest.mark.parametrize("text,value", [("500m", Decimal("0.5")), ("2", Decimal(2)), ("8Gi", Decimal(8 * 2**30)),
                                        ("1e3", Decimal(1000)), ("1.5G", Decimal("1.5e9")), ("100Mi", 100 * 2**20),
                                        (" 4 ", Decimal(4)), (10, Decimal(10)), ("0.1", Decimal("0.1"))])
def test_quantities_parse_like_kubernetes(text, value):
    assert quantity.parse(text) == value


@pytest.mark.parametrize("text", ["lots", "-1", "1.5Gb", "", "Gi", 1.5, True, None])
def test_malformed_quantities_are_refused_naming_the_text(text):
    with pytest.raises(ValueError, match=f"{text!r} is not a Kubernetes quantity"):
        quantity.parse(text)
