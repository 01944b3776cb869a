"""The one error a model that cannot be loaded raises (a leaf, so every model module can raise it)."""

from __future__ import annotations

from adpfleet.model_uri import INVALID_MODEL, ModelSourceError


class ModelLoadError(ModelSourceError):
    """A model directory, config or checkpoint that cannot be loaded; the message names the culprit.

    `reason` is one of the stable reasons of `adpfleet.model_uri` (InvalidModel unless more specific:
    UnsupportedModelType, NoSafetensors), so `serve` reports a broken model the way `fetch-model` does."""

    def __init__(self, message: str, reason: str = INVALID_MODEL):
        super().__init__(reason, message)
