"""Every model URI to a directory the engine loads: `resolve_model` (serve, generate) and
`adpfleet fetch-model` (the init container, or by hand).

A directory or pvc:// source is checked where it is; hf:// and s3:// are fetched once into the
cache (`cache.fill_once`): metadata first, then checked (config.json, a supported model_type,
safetensors present, names that stay inside the model directory, room on the disk) before a single
weight byte is downloaded; every file is fetched under watch (`transfer.fetch_files`: no more than
listed, no stall past the deadline).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from adpfleet.model_uri import (CACHE_LIMIT_ENV, DIRECTORY_NOT_FOUND, DISK_FULL, INVALID_MODEL,
                                OBJECT_NOT_FOUND, SOURCE_UNREACHABLE, VOLUME_NOT_MOUNTED, ModelSourceError,
                                ModelURI, default_cache_root, fetched_message, parse_model_uri,
                                write_termination_message)
from adpfleet.runtime.model.sources.cache import fill_once
from adpfleet.runtime.model.sources.files import metadata_files, weight_files
from adpfleet.runtime.model.sources.progress import Progress, bytes_under
from adpfleet.runtime.model.sources.transfer import fetch_files, size_of

log = logging.getLogger("adpfleet.fetch")


@dataclass(frozen=True)
class ResolvedModel:
    path: str  # what the engine loads: a model directory or a built-in name
    served_name: str  # the model id the API reports unless --served-model-name says otherwise
    revision: str | None = None  # hf: the commit it was fetched at


def resolve_model(text: str, cache_dir: str | None = None, dest: str | None = None,
                  engine: str = "adpfleet") -> ResolvedModel:
    """The local model `text` names, fetching it first if it is remote and not in the cache (checked as
    `engine` will load it before any weight byte)."""
    uri = parse_model_uri(text)
    try:
        if uri.kind == "builtin":
            return ResolvedModel(uri.name, uri.served_name)
        if not uri.downloads:
            path = Path(uri.local_dir())
            if not path.is_dir():
                if uri.kind == "pvc":
                    raise ModelSourceError(VOLUME_NOT_MOUNTED, f"{text}: {path} does not exist (is the claim "
                                                               f"{uri.name!r} mounted at {path.parents[0]}?)")
                raise ModelSourceError(DIRECTORY_NOT_FOUND, f"model directory {path} does not exist")
            return ResolvedModel(str(path), uri.served_name)
        final = Path(dest) if dest else Path(uri.cache_dir(cache_dir or default_cache_root()))
        marker = fill_once(final, lambda partial: _download(uri, partial, engine))
        log.info("%s is in %s%s", text, final, f" (revision {marker['revision']})" if marker.get("revision") else "")
        return ResolvedModel(str(final), uri.served_name, marker.get("revision"))
    except ModelSourceError as e:
        e.uri = e.uri or text
        raise


def _download(uri: ModelURI, partial: Path, engine: str) -> dict:
    from adpfleet.runtime.model.checkpoint import check_config

    source = _source(uri)
    with _disk_errors(partial), source.errors():
        listing = source.list()
        if "config.json" not in listing:
            raise ModelSourceError(OBJECT_NOT_FOUND if uri.kind == "s3" else INVALID_MODEL,
                                   f"{uri.uri} has no config.json (is it a Hugging Face model?)")
        label = f"hf://{uri.name}@{source.revision}" if uri.kind == "hf" else uri.uri  # the commit it pins
        metadata = metadata_files(listing)
        _fetch(source, metadata, listing, partial, label)
        model_type = check_config(partial, engine)  # refuses a model the engine cannot load before the weights
        weights = weight_files(listing, partial, uri.uri)
        total = sum(listing[n] for n in weights)
        log.info("%s: %s, %d weight files", label, model_type, len(weights))
        t0 = time.monotonic()
        with Progress(partial, total + bytes_under(partial) - sum(size_of(partial / n) for n in weights), label):
            _fetch(source, weights, listing, partial, label)
        log.info("%s: fetched in %.1f s", label, time.monotonic() - t0)
    return {"uri": uri.uri, "revision": source.revision, "files": sorted(metadata + weights),
            "bytes": total + sum(listing[n] for n in metadata),
            **({"etags": {n: source.etags[n] for n in weights}} if uri.kind == "s3" else {})}


def _source(uri: ModelURI):
    if uri.kind == "hf":
        from adpfleet.runtime.model.sources.hf import HubSource
        return HubSource(uri)
    from adpfleet.runtime.model.sources.s3 import S3Source
    return S3Source(uri)


def _fetch(source, names: list[str], listing: dict[str, int], partial: Path, label: str) -> None:
    """`names` into `partial`, at the sizes listed: room for them first, then under watch."""
    files = {n: listing[n] for n in names}
    _check_room(partial, sum(files.values()) - sum(size_of(partial / n) for n in names))
    fetch_files(lambda name: source.fetch(name, partial), files, partial, label)


def _check_room(directory: Path, needed: int) -> None:
    """Refuses a download that will not fit `directory`'s volume: its free space, or what
    CACHE_LIMIT_ENV leaves of the cache (`directory`'s parent) beyond what it holds already."""
    free = shutil.disk_usage(directory).free
    limit = os.environ.get(CACHE_LIMIT_ENV)
    if limit:
        free = min(free, max(int(limit) - bytes_under(directory.parent), 0))
    if needed > free:
        raise ModelSourceError(DISK_FULL, f"the model needs {needed / 1e9:.2f} GB more and {directory.parent} "
                                          f"has {free / 1e9:.2f} GB free (raise the cache volume's size)")


@contextmanager
def _disk_errors(directory: Path):
    try:
        yield
    except ModelSourceError:
        raise
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e):
            raise ModelSourceError(DISK_FULL, f"{directory.parent} ran out of space: {e}") from None
        if any(c.__name__ in ("ConnectError", "TimeoutException", "TransportError", "ConnectionError")
               for c in type(e).__mro__):
            raise ModelSourceError(SOURCE_UNREACHABLE, str(e)) from None
        raise
    except Exception as e:  # the HTTP clients' transport errors are not all OSErrors
        if any(c.__name__ in ("ConnectError", "TimeoutException", "TransportError") for c in type(e).__mro__):
            raise ModelSourceError(SOURCE_UNREACHABLE, f"{type(e).__name__}: {e}") from None
        raise


def main(args) -> int:
    """`adpfleet fetch-model URI [--dest DIR] [--cache-dir DIR] [--engine E]`: fetches (or finds) the model,
    checks what loading would refuse first, prints the model's directory."""
    from adpfleet.runtime.model.checkpoint import check_model_dir

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = resolve_model(args.model, args.cache_dir, args.dest, args.engine)
    if parse_model_uri(args.model).kind != "builtin":
        try:
            check_model_dir(Path(model.path), args.engine)
        except ModelSourceError as e:
            e.uri = args.model
            raise
    if model.revision:  # the commit it was fetched at, for the operator (status.model.revision)
        write_termination_message(fetched_message(args.model, model.revision))
    print(model.path, flush=True)
    return 0
