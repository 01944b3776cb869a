"""Names a model source may use, as regular expressions both Python's `re` and the API server's CEL
(RE2) read the same way: unanchored, plain groups. `adpfleet.model_uri` parses with them and the
operator's CRD rules (operator/resource/model_source.py) enforce them at admission."""

from __future__ import annotations

HF_NAME = "[A-Za-z0-9]([A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"  # an organisation or a repository on the Hub
HF_REVISION = "[A-Za-z0-9._][A-Za-z0-9._/-]{0,254}"         # a branch, tag or commit
S3_BUCKET = "[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"
DNS_LABEL = "[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"            # one label of a claim's DNS-subdomain name
