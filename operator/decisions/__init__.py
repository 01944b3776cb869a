"""Decisions as pure functions: desired objects from the spec, the next actions from desired and
observed state, the status from both. Nothing here talks to the API server."""
