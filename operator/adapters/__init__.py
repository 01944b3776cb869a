"""Adapters to the outside world: the Kubernetes API (and, with remediation, the metrics scraper)."""
