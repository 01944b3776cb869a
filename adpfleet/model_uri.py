"""Where a model comes from: the model-source URI, where it lands on disk, and why it could not be had.

Standard library only: the operator imports this (to validate a fleet's model source, to build
its pods, to read a failed pod's termination message) without torch or pydantic.

    tiny, tiny-dense                 built-in models (no download)
    hf://ORG/REPO[@REVISION]         a Hugging Face Hub repository (HF_ENDPOINT for a mirror)
    s3://BUCKET[/PREFIX]             an S3 or S3-compatible bucket (AWS_ENDPOINT_URL for MinIO, Ceph)
    pvc://CLAIM[/PATH]               a PersistentVolumeClaim, mounted at PVC_MOUNT_ROOT/CLAIM
    /a/dir, rel/dir, file:///a/dir   a model directory (e.g. baked into the image)

`parse_model_uri(text)` returns a `ModelURI` or raises `ModelURIError` naming the part that is
wrong. Downloads (hf, s3) land in `ModelURI.cache_dir(root)`, a directory that exists only once
complete (filled in `<dir>.partial`, marked with COMPLETE_MARKER, renamed into place).

A model that cannot be had is a `ModelSourceError` with a stable `reason` (the REASONS below, in
Kubernetes' CamelCase) and an exit code per reason. `adpfleet fetch-model` and `adpfleet serve`
exit with that code and write `termination_message(...)` — one JSON object
`{"reason", "message", "exitCode", "uri"}` — to TERMINATION_LOG, which Kubernetes shows as the
container's `state.terminated.message`; `parse_termination_message` reads it back. A fetch that
succeeds leaves `fetched_message(...)` there instead — `{"uri", "revision"}`, the commit an hf://
model was fetched at — which the operator reports as `status.model.revision`.

A download logs its progress every few seconds (`progress_line`, `progress_start_line`); the
operator reads bytes done / total back from the init container's log with `parse_progress`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from urllib.parse import quote

from adpfleet.contract import name_patterns

BUILTIN_MODELS = ("tiny", "tiny-dense")
# Where the operator mounts a pvc:// source's claim (read-only), and the download cache volume.
PVC_MOUNT_ROOT = "/mnt/adpfleet/pvc"
PVC_ROOT_ENV = "ADPFLEET_PVC_ROOT"  # overrides PVC_MOUNT_ROOT (outside Kubernetes, tests)
CACHE_MOUNT_PATH = "/var/cache/adpfleet/models"
CACHE_ENV = "ADPFLEET_MODEL_CACHE"  # the cache root when --cache-dir is not given
# What the cache volume may hold, in bytes, where the file system does not say: an emptyDir's
# sizeLimit is enforced by the kubelet evicting the pod, not by ENOSPC (the operator sets it).
CACHE_LIMIT_ENV = "ADPFLEET_CACHE_SIZE_LIMIT"
COMPLETE_MARKER = ".adpfleet-complete.json"
TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath
TERMINATION_LOG_ENV = "ADPFLEET_TERMINATION_LOG"
TERMINATION_MESSAGE_LIMIT = 4096  # bytes Kubernetes keeps of a termination message

# The stable reasons a model cannot be had, and the exit code of each.
INVALID_MODEL_URI = "InvalidModelURI"
REPOSITORY_NOT_FOUND = "RepositoryNotFound"
UNAUTHORIZED = "Unauthorized"
ACCESS_DENIED = "AccessDenied"
REVISION_NOT_FOUND = "RevisionNotFound"
NO_SAFETENSORS = "NoSafetensors"
UNSUPPORTED_MODEL_TYPE = "UnsupportedModelType"
INVALID_MODEL = "InvalidModel"
BUCKET_NOT_FOUND = "BucketNotFound"
OBJECT_NOT_FOUND = "ObjectNotFound"
INVALID_CREDENTIALS = "InvalidCredentials"
DISK_FULL = "DiskFull"
VOLUME_NOT_MOUNTED = "VolumeNotMounted"
DIRECTORY_NOT_FOUND = "DirectoryNotFound"
SOURCE_UNREACHABLE = "SourceUnreachable"
UNSAFE_FILE_NAME = "UnsafeFileName"
SIZE_MISMATCH = "SizeMismatch"
FETCH_STALLED = "FetchStalled"

REASONS: dict[str, tuple[int, str]] = {
    INVALID_MODEL_URI: (10, "the model URI is malformed"),
    REPOSITORY_NOT_FOUND: (11, "the Hugging Face repository does not exist (or is private and no token was given)"),
    UNAUTHORIZED: (12, "the repository is gated or private: no token, or a token the source does not accept"),
    ACCESS_DENIED: (13, "the token or credentials are valid but not allowed this repository or bucket"),
    REVISION_NOT_FOUND: (14, "the repository has no such branch, tag or commit"),
    NO_SAFETENSORS: (15, "the source has no *.safetensors weights (or a shard its index names is missing)"),
    UNSUPPORTED_MODEL_TYPE: (16, "config.json names a model_type adpfleet does not run"),
    INVALID_MODEL: (17, "config.json, the tokenizer or the checkpoint is missing or malformed"),
    BUCKET_NOT_FOUND: (18, "the S3 bucket does not exist"),
    OBJECT_NOT_FOUND: (19, "no object under the S3 prefix (or no config.json there)"),
    INVALID_CREDENTIALS: (20, "the S3 credentials are missing or wrong"),
    DISK_FULL: (21, "the cache volume has no room for the model"),
    VOLUME_NOT_MOUNTED: (22, "the pvc:// path is not there: the claim is not mounted or the path is wrong"),
    DIRECTORY_NOT_FOUND: (23, "the model directory does not exist"),
    SOURCE_UNREACHABLE: (24, "the hub or S3 endpoint could not be reached or failed"),
    UNSAFE_FILE_NAME: (25, "the source names a file outside the model directory (an absolute path, '..', a symbolic "
                           "link out): refused before it is written or read"),
    SIZE_MISMATCH: (26, "the source served a file of another size than it listed (stopped once it served more)"),
    FETCH_STALLED: (27, "the download made less than 1 MB of progress within the stall deadline"),
}


def reason_of_exit_code(code: int | None) -> str | None:
    """The reason a fetch-model or serve exit code stands for (when no termination message came)."""
    return next((reason for reason, (c, _) in REASONS.items() if c == code), None)


class ModelSourceError(ValueError):
    """A model that cannot be had, with its stable `reason` and exit code."""

    def __init__(self, reason: str, message: str, uri: str | None = None):
        if reason not in REASONS:
            raise ValueError(f"unknown model-source failure reason {reason!r}")
        super().__init__(message)
        self.reason, self.message, self.uri = reason, message, uri

    @property
    def exit_code(self) -> int:
        return REASONS[self.reason][0]


class ModelURIError(ModelSourceError):
    """A malformed model URI; `part` names what is wrong (scheme, repo, revision, bucket, prefix,
    claim, path)."""

    def __init__(self, uri: str, part: str, problem: str):
        super().__init__(INVALID_MODEL_URI, f"model URI {uri!r}: {part} {problem}", uri)
        self.part = part


_HF_NAME = re.compile(f"^{name_patterns.HF_NAME}$")
_REVISION = re.compile(f"^{name_patterns.HF_REVISION}$")
_BUCKET = re.compile(f"^{name_patterns.S3_BUCKET}$")
_CLAIM = re.compile(rf"^{name_patterns.DNS_LABEL}(\.{name_patterns.DNS_LABEL})*$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
SCHEMES = ("hf", "s3", "pvc", "file")


@dataclass(frozen=True)
class ModelURI:
    kind: str  # "builtin", "directory", "hf", "s3" or "pvc"
    uri: str  # as written
    name: str = ""  # the built-in name, hf repo id, s3 bucket or pvc claim
    path: str = ""  # the s3 prefix, the path inside the claim, or the directory
    revision: str | None = None  # hf: branch, tag or commit; None for the default branch

    @property
    def downloads(self) -> bool:
        """Fetched into the cache (hf, s3) rather than read where it is."""
        return self.kind in ("hf", "s3")

    @property
    def served_name(self) -> str:
        """The model id the OpenAI API reports by default: the repository's name, else the last
        segment of the path or prefix."""
        if self.kind == "builtin":
            return self.name
        if self.kind == "hf":
            return self.name.rsplit("/", 1)[-1]
        tail = self.path.rstrip("/").rsplit("/", 1)[-1]
        return tail or self.name or self.path

    def cache_dir(self, root: str) -> str:
        """Where a download lands under the cache root: one directory per repo and revision (or
        bucket and prefix)."""
        if not self.downloads:
            raise ValueError(f"{self.uri} is not downloaded")
        if self.kind == "hf":
            key = "hf--" + self.name.replace("/", "--") + "--" + quote(self.revision or "main", safe="")
        else:
            key = "s3--" + self.name + ("--" + quote(self.path, safe="") if self.path else "")
        if len(key) > 200:  # a file name must stay under 255 bytes with its .partial / .lock suffix
            key = key[:160] + "--" + hashlib.sha256(key.encode()).hexdigest()[:16]
        return os.path.join(root, key)

    def local_dir(self, pvc_root: str | None = None) -> str:
        """The model directory of a directory or pvc:// source (pvc: under the claim's mount)."""
        if self.kind == "directory":
            return self.path
        if self.kind == "pvc":
            root = pvc_root or os.environ.get(PVC_ROOT_ENV) or PVC_MOUNT_ROOT
            return os.path.join(root, self.name, self.path)
        raise ValueError(f"{self.uri} has no local directory until it is fetched")


def parse_model_uri(text: str) -> ModelURI:
    """The model source `text` names; raises ModelURIError naming the wrong part."""
    if not isinstance(text, str) or not text.strip():
        raise ModelURIError(str(text), "the URI", "is empty")
    if text != text.strip() or any(c.isspace() or ord(c) < 32 for c in text):
        raise ModelURIError(text, "the URI", "contains whitespace or control characters")
    if text in BUILTIN_MODELS:
        return ModelURI("builtin", text, name=text)
    m = _SCHEME.match(text)
    if m is None:
        return ModelURI("directory", text, path=text)
    scheme, rest = m.group(1), text[m.end():]
    if scheme not in SCHEMES:
        raise ModelURIError(text, "scheme", f"{scheme!r} is not supported; use hf://, s3://, pvc://, "
                                            f"a directory or a built-in name ({', '.join(BUILTIN_MODELS)})")
    if scheme == "file":
        if not rest.startswith("/"):
            raise ModelURIError(text, "path", "must be absolute (file:///dir)")
        return ModelURI("directory", text, path=rest)
    if scheme == "hf":
        return _parse_hf(text, rest)
    head, _, tail = rest.partition("/")
    path = _relative_path(text, "prefix" if scheme == "s3" else "path", tail)
    if scheme == "s3":
        if not _BUCKET.match(head) or ".." in head:
            raise ModelURIError(text, "bucket", f"{head!r} is not an S3 bucket name "
                                                "(3-63 lowercase letters, digits, dots and hyphens)")
        return ModelURI("s3", text, name=head, path=path)
    if len(head) > 253 or not _CLAIM.match(head):
        raise ModelURIError(text, "claim", f"{head!r} is not a PersistentVolumeClaim name "
                                           "(a lowercase DNS subdomain)")
    return ModelURI("pvc", text, name=head, path=path)


def _parse_hf(text: str, rest: str) -> ModelURI:
    repo, at, revision = rest.partition("@")
    parts = repo.split("/")
    if not repo or len(parts) > 2 or not all(parts):
        raise ModelURIError(text, "repo", "must be ORG/REPO (hf://ORG/REPO[@REVISION])")
    for part in parts:
        if not _HF_NAME.match(part) or "--" in part or ".." in part:
            raise ModelURIError(text, "repo", f"{part!r} is not a Hugging Face name (letters, digits, "
                                              "'-', '_', '.'; at most 96; no '--' or '..')")
    if at and (not _REVISION.match(revision) or ".." in revision or revision.endswith("/")):
        raise ModelURIError(text, "revision", f"{revision!r} is not a branch, tag or commit")
    return ModelURI("hf", text, name=repo, revision=revision if at else None)


def _relative_path(text: str, part: str, path: str) -> str:
    segments = [s for s in path.split("/") if s]
    if any(s in (".", "..") for s in segments):
        raise ModelURIError(text, part, "must not contain '.' or '..' segments")
    if len(path) > 1024:
        raise ModelURIError(text, part, "is longer than 1024 characters")
    return "/".join(segments)


def default_cache_root() -> str:
    """$ADPFLEET_MODEL_CACHE, else $XDG_CACHE_HOME/adpfleet/models (~/.cache by default)."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "adpfleet", "models")


def termination_message(error: ModelSourceError) -> str:
    """The JSON a failed fetch or serve leaves for Kubernetes (at most 4096 bytes)."""
    body = {"reason": error.reason, "message": error.message, "exitCode": error.exit_code, "uri": error.uri}
    text = json.dumps(body)
    while len(text.encode()) > TERMINATION_MESSAGE_LIMIT:
        body["message"] = body["message"][:len(body["message"]) - (len(text.encode()) - TERMINATION_MESSAGE_LIMIT)
                                           - 4] + "..."
        text = json.dumps(body)
    return text


def parse_termination_message(text: str | None) -> ModelSourceError | None:
    """The failure a container's termination message reports; None if it is not one of ours."""
    try:
        body = json.loads(text or "")
        return ModelSourceError(body["reason"], str(body["message"]), body.get("uri"))
    except (ValueError, KeyError, TypeError):
        return None


def fetched_message(uri: str, revision: str) -> str:
    """The JSON a successful fetch leaves for Kubernetes: the commit the model was fetched at."""
    return json.dumps({"uri": uri[:1024], "revision": revision[:128]})


def parse_fetched_revision(text: str | None) -> str | None:
    """The revision a successful fetch's termination message reports; None if it is not one."""
    try:
        revision = json.loads(text or "").get("revision")
    except (ValueError, AttributeError):
        return None
    return revision if isinstance(revision, str) and revision else None


def write_termination_message(message: ModelSourceError | str) -> str | None:
    """Writes a failure (`termination_message`) or a ready JSON text to $ADPFLEET_TERMINATION_LOG,
    else to /dev/termination-log where Kubernetes provides it; returns the path written, or None
    outside Kubernetes. Never raises."""
    path = os.environ.get(TERMINATION_LOG_ENV) or (TERMINATION_LOG if os.path.exists(TERMINATION_LOG) else None)
    if not path:
        return None
    try:
        with open(path, "w") as f:
            f.write(message if isinstance(message, str) else termination_message(message))
    except OSError:
        return None
    return path


# ---- download progress: the log lines fetch-model writes and the operator reads back ----

def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def progress_start_line(label: str, total: int, already: int) -> str:
    return f"{label}: downloading {_mb(total)} ({_mb(already)} already here)"


def progress_amount(done: int, total: int) -> str:
    """'52.4 MB of 104.9 MB (50%)'"""
    return f"{_mb(done)} of {_mb(total)}" + (f" ({100 * done / total:.0f}%)" if total else "")


def progress_line(label: str, done: int, total: int, rate: float) -> str:
    return f"{label}: {progress_amount(done, total)} at {_mb(rate)}/s"


_PROGRESS = re.compile(r": (\d+\.\d) MB of (\d+\.\d) MB|: downloading (\d+\.\d) MB \((\d+\.\d) MB already here\)")


def parse_progress(log: str) -> tuple[int, int] | None:
    """(bytes done, bytes total) from the last progress line in `log` (to 0.1 MB), or None."""
    found = None
    for m in _PROGRESS.finditer(log or ""):
        found = m
    if found is None:
        return None
    done, total, start_total, already = found.groups()
    if total is None:
        done, total = already, start_total
    return round(float(done) * 1e6), round(float(total) * 1e6)
