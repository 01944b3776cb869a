"""Which files of a model repository or bucket the runtime needs, and nothing else.

The metadata (config, tokenizer, chat template, the safetensors index) comes first; the weights
are the shards the index names, or every top-level `*.safetensors` file when there is no index.
Other formats (`*.bin`, `*.pth`, `original/`, `consolidated.*`, GGUF) are never downloaded. Every
weight name is the store's to choose, so each must stay inside the model directory
(`checkpoint.model_file`) before a byte is fetched.
"""

from __future__ import annotations

import json
from pathlib import Path

from adpfleet.model_uri import NO_SAFETENSORS, ModelSourceError
from adpfleet.runtime.model.checkpoint import INDEX_FILE, model_file

METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "chat_template.json", INDEX_FILE)


def metadata_files(listing: dict[str, int]) -> list[str]:
    return [name for name in METADATA_FILES if name in listing]


def weight_files(listing: dict[str, int], metadata_dir: Path, source: str) -> list[str]:
    """The safetensors files to fetch, given the listing and the metadata already fetched."""
    index = metadata_dir / INDEX_FILE
    names = _indexed_shards(index, source) if index.is_file() else \
        sorted(n for n in listing if n.endswith(".safetensors") and "/" not in n)
    for name in names:
        model_file(metadata_dir, name, f"{source}: {INDEX_FILE if index.is_file() else 'its listing'}")
    missing = [n for n in names if n not in listing]
    if missing:
        raise ModelSourceError(NO_SAFETENSORS, f"{source}: {INDEX_FILE} names shards the source does not "
                                               f"have: {', '.join(missing)}")
    if not names:
        others = sorted(n for n in listing if n.endswith((".bin", ".pth", ".pt", ".gguf", ".h5", ".msgpack")))
        hint = f" (it has {', '.join(others[:3])}: convert them to safetensors)" if others else ""
        raise ModelSourceError(NO_SAFETENSORS, f"{source} has no *.safetensors weights{hint}")
    return names


def _indexed_shards(index: Path, source: str) -> list:
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelSourceError(NO_SAFETENSORS, f"{source}: {INDEX_FILE} is not a safetensors index ({e})") from None
