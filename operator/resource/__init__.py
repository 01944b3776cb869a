"""The InferenceFleet resource: its pydantic models (the single source of truth: `models.py` the spec's
root, its parts, `status.py`, `fleet_role.py`, all built on `cel.py`), the CRD and the configuration
reference generated from them, and the names and labels every other floor shares."""
