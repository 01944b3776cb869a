"""Kubernetes resource quantities: the contract's (adpfleet/contract/quantity.py), named here only for
decisions/desired.py until the branch reworking it imports the contract itself; nothing new imports this."""

from adpfleet.contract.quantity import PATTERN, SIGNED_PATTERN, parse  # noqa: F401
