"""The files of a model directory: which safetensors files hold its weights, and the one rule for
every file name a model's source gives (torch-free, so that `fetch-model` checks a model without
importing torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from adpfleet.model_uri import NO_SAFETENSORS, UNSAFE_FILE_NAME
from adpfleet.runtime.model.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def model_file(directory: Path, name: object, named_by: str) -> Path:
    """`directory / name` for a file name that came from a model's source — a bucket's listing, a
    hub's file list, a safetensors index — refused (UnsafeFileName) unless it stays inside
    `directory`: a store that names `../../x` or `/home/u/.local/.../x.pth` is writing (or making
    the loader read) outside the model, so neither the fetch nor the loader follows it."""
    escape = _escape(directory, name)
    if escape:
        raise ModelLoadError(f"{named_by} names {name!r}, which escapes the model directory ({escape})",
                             UNSAFE_FILE_NAME)
    return directory / name


def _escape(directory: Path, name: object) -> str | None:
    if not isinstance(name, str) or not name:
        return "not a file name"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "a control character"
    if name.startswith("/"):
        return "an absolute path"
    if ".." in name.split("/"):
        return "a '..' segment"
    root = os.path.realpath(directory)
    real = os.path.realpath(directory / name)
    if os.path.commonpath([root, real]) != root:
        return f"a symbolic link to {real}"
    return None


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: the shards its index names, else every
    `*.safetensors` file."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a safetensors index ({e})") from None
        files = [model_file(path, name, str(index)) for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}", NO_SAFETENSORS)
        return files
    files = [model_file(path, f.name, str(path)) for f in sorted(path.glob("*.safetensors"))]
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights", NO_SAFETENSORS)
    return files


def check_model_dir(path: Path, engine: str = "adpfleet") -> None:
    """What loading would refuse first, without reading weights: `check_config`, the safetensors files."""
    check_config(path, engine)
    checkpoint_files(path)


def check_config(path: Path, engine: str = "adpfleet") -> str:
    """The model_type of the directory's config.json, refused (ModelLoadError) unless the engine would
    load it: adpfleet's engine checks that it runs the model_type and the fields it reads; for vLLM
    (`engine="vllm"`) the architecture is vLLM's to judge (it runs many adpfleet does not), so only a
    model_type must be named. Either way the weights must be safetensors whose names stay in the
    directory: a store's `*.bin` is a pickle, and nothing fetched from outside is unpickled."""
    from adpfleet.runtime.model.config import ModelConfig, read_config_json

    raw = read_config_json(path)
    if engine == "adpfleet":
        return ModelConfig.from_dict(raw, str(path / "config.json")).model_type
    if not isinstance(raw.get("model_type"), str) or not raw["model_type"]:
        raise ModelLoadError(f"{path / 'config.json'}: model_type must be a non-empty string (vLLM picks the "
                             f"architecture by it); got {raw.get('model_type')!r}")
    return raw["model_type"]
