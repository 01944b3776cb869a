"""adpfleet: an ADP inference runtime and a Kubernetes operator that keeps LLM fleets moving."""

__version__ = "0.1.0"
