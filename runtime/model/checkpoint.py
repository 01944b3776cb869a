"""The files of a model directory: which safetensors files hold its weights (torch-free, so that
`fetch-model` checks a model without importing torch)."""

from __future__ import annotations

import json
from pathlib import Path

from adpfleet.model_uri import NO_SAFETENSORS
from adpfleet.runtime.model.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: the shards its index names, else every
    `*.safetensors` file."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [path / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a safetensors index ({e})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}", NO_SAFETENSORS)
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights", NO_SAFETENSORS)
    return files


def check_model_dir(path: Path) -> None:
    """What loading would refuse first, without reading weights: config.json, a supported
    model_type, the safetensors files."""
    from adpfleet.runtime.model.config import ModelConfig

    ModelConfig.from_dir(path)
    checkpoint_files(path)
