"""The InferenceFleet resource: its pydantic models (the single source of truth), the CRD and the
configuration reference generated from them, and the names and labels every other floor shares."""
