"""The roles a server can carry: `adpfleet serve --role`, the router's pools and the operator's fleet roles
(the CRD's role fields and the `adpfleet.io/role` label) use these names."""

AGGREGATED = "aggregated"  # one role whose servers prefill and decode (no KV hand-off)
SPLIT_ROLES = ("context", "generation")  # a disaggregated fleet's roles
SERVER_ROLES = (*SPLIT_ROLES, AGGREGATED)  # every role a server pod can carry
