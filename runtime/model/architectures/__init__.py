"""One module per model architecture, each declaring `ARCHITECTURE` (see `registry.py`)."""
