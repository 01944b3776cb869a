"""A local Hugging Face Hub: serves model directories the way the Hub's HTTP API does, so that the
real `huggingface_hub` client downloads from it through HF_ENDPOINT (tests, benchmarks and the
local cluster; loopback only).

What it answers, as the Hub does:
- `GET /api/models/ORG/REPO[/revision/REV]` — the repo's info: `sha` (the commit the revision
  resolves to) and `siblings` (with sizes and LFS sha256 when `?blobs=true`);
- `GET /api/models/ORG/REPO/tree/REV` — the file listing;
- `HEAD|GET /ORG/REPO/resolve/REV/FILE` — small files directly (ETag = git blob id,
  X-Repo-Commit); `*.safetensors` as LFS files: a 302 to the "CDN" (the same server on a second
  loopback address, as the Hub's CDN is another host) `/lfs-objects/SHA256` with X-Linked-Etag and
  X-Linked-Size, where the bytes are served with Range support;
- the Hub's errors with their `X-Error-Code`: `RepoNotFound` (401 without a token, 404 with one),
  `RevisionNotFound` (404), `EntryNotFound` (404), `GatedRepo` (401 without a valid token, 403
  with a token that was not granted access; the repo's info stays public, as on the Hub).
Faults for tests: `cut_after[file] = n` ends the first response for that file after n bytes;
`throttle[file] = bytes/s` slows its body; `listed_size[file] = n` makes the repo's info list it
at n bytes whatever it serves; `add_commit(..., files={name: path})` publishes files under names a
directory cannot hold (`../x`). `log` records (method, path, Range) of every request.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".gguf")
_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_LFS = re.compile(r"^/lfs-objects/([0-9a-f]{64})$")


@dataclass
class Blob:
    path: Path
    size: int
    git_sha1: str
    sha256: str | None  # LFS files only


@dataclass
class Repo:
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    granted: set[str] = field(default_factory=set)  # tokens with access to a gated repo


def _blob(path: Path, name: str) -> Blob:
    data = path.read_bytes()
    git_sha1 = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    lfs = hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else None
    return Blob(path, len(data), git_sha1, lfs)


class LocalHub:
    def __init__(self, tokens: set[str] = frozenset()):
        self.repos: dict[str, Repo] = {}
        self.tokens = set(tokens)  # tokens the hub knows (valid logins)
        self.cut_after: dict[str, int] = {}
        self.throttle: dict[str, float] = {}
        self.listed_size: dict[str, int] = {}
        self.log: list[tuple[str, str, str | None]] = []
        self._lfs: dict[str, Blob] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._cdn: ThreadingHTTPServer | None = None

    # -- content ---------------------------------------------------------------------------------
    def add_commit(self, repo_id: str, directory: Path | None, ref: str = "main", gated: bool = False,
                   granted: set[str] = frozenset(), files: dict[str, Path] | None = None) -> str:
        """Publishes `directory` (and `files`, name -> path) as a new commit of `repo_id` and points
        `ref` at it; returns the sha."""
        repo = self.repos.setdefault(repo_id, Repo())
        repo.gated = repo.gated or gated
        repo.granted |= set(granted)
        files = {**({p.relative_to(directory).as_posix(): p for p in sorted(Path(directory).rglob("*"))
                     if p.is_file()} if directory else {}), **(files or {})}
        blobs = {name: _blob(p, name) for name, p in files.items()}
        sha = hashlib.sha1(json.dumps([repo_id, len(repo.commits)] +
                                      [[n, b.git_sha1] for n, b in blobs.items()]).encode()).hexdigest()
        repo.commits[sha] = blobs
        repo.refs[ref] = sha
        for blob in blobs.values():
            if blob.sha256:
                self._lfs[blob.sha256] = blob
        return sha

    def gets(self, suffix: str) -> list[str | None]:
        """The Range headers of the GETs of bytes whose path ends with `suffix` (a file name)."""
        blobs = {b.sha256 for r in self.repos.values() for c in r.commits.values()
                 for n, b in c.items() if n.endswith(suffix) and b.sha256}
        with self._lock:
            return [rng for method, path, rng in self.log if method == "GET" and
                    (path.endswith("/" + suffix) or path.rsplit("/", 1)[-1] in blobs)]

    # -- serving ---------------------------------------------------------------------------------
    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            pass
        Handler.hub = hub
        self._server, self._cdn = (ThreadingHTTPServer((host, 0), Handler) for host in ("127.0.0.1", "127.0.0.2"))
        for server in (self._server, self._cdn):
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, name="local-hub", daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def cdn_url(self) -> str:
        host, port = self._cdn.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        for server in (self._server, self._cdn):
            if server:
                server.shutdown()
                server.server_close()

    def __enter__(self) -> "LocalHub":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: LocalHub

    def log_message(self, *args) -> None:  # quiet: the hub keeps its own log
        pass

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    def _route(self, body: bool) -> None:
        path = urlsplit(self.path).path
        with self.hub._lock:
            self.hub.log.append((self.command, path, self.headers.get("Range")))
        if m := _LFS.match(path):
            blob = self.hub._lfs.get(m.group(1))
            return self._bytes(blob, body) if blob else self._error(404, "EntryNotFound", "no such object")
        if m := _API.match(path):
            return self._api(m.group(1), m.group(2), unquote(m.group(3) or "main"), body)
        if m := _RESOLVE.match(path):
            return self._resolve(m.group(1), unquote(m.group(2)), unquote(m.group(3)), body)
        self._error(404, None, f"no route for {path}")

    # -- the Hub's rules -------------------------------------------------------------------------
    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer "):] if auth.startswith("Bearer ") else None

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            authenticated = self._token() in self.hub.tokens
            self._error(404 if authenticated else 401, "RepoNotFound", f"Repository {repo_id} not found")
        return repo

    def _commit(self, repo_id: str, repo: Repo, revision: str) -> tuple[str, dict[str, Blob]] | None:
        sha = repo.refs.get(revision) or (revision if revision in repo.commits else None)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return sha, repo.commits[sha]

    def _api(self, repo_id: str, kind: str | None, revision: str, body: bool) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        found = self._commit(repo_id, repo, revision)
        if found is None:
            return
        sha, blobs = found
        if kind == "tree":
            return self._json([{"type": "file", "path": name, "size": b.size, "oid": b.git_sha1,
                                **({"lfs": {"oid": b.sha256, "size": b.size, "pointerSize": 134}} if b.sha256 else {})}
                               for name, b in blobs.items()], body)
        with_blobs = "blobs=true" in (urlsplit(self.path).query or "").lower()
        siblings = [{"rfilename": name, **({"size": self.hub.listed_size.get(name, b.size), "blobId": b.git_sha1}
                                           if with_blobs else {}),
                     **({"lfs": {"sha256": b.sha256, "size": b.size, "pointerSize": 134}}
                        if with_blobs and b.sha256 else {})} for name, b in blobs.items()]
        self._json({"_id": sha[:24], "id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                    "gated": "manual" if repo.gated else False, "disabled": False, "siblings": siblings}, body)

    def _resolve(self, repo_id: str, revision: str, name: str, body: bool) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        if repo.gated:
            token = self._token()
            if token not in self.hub.tokens:
                return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have "
                                                     "access to it and be authenticated to access it.")
            if token not in repo.granted:
                return self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are "
                                                     "not in the authorized list.")
        found = self._commit(repo_id, repo, revision)
        if found is None:
            return
        sha, blobs = found
        blob = blobs.get(name)
        if blob is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist at {revision}")
        if blob.sha256:  # LFS: the Hub redirects to its CDN
            self.send_response(302)
            self.send_header("Location", f"{self.hub.cdn_url}/lfs-objects/{blob.sha256}")
            self.send_header("X-Repo-Commit", sha)
            self.send_header("X-Linked-Etag", f'"{blob.sha256}"')
            self.send_header("X-Linked-Size", str(blob.size))
            self.send_header("ETag", f'"{blob.git_sha1}"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._bytes(blob, body, {"X-Repo-Commit": sha, "ETag": f'"{blob.git_sha1}"'})

    # -- responses -------------------------------------------------------------------------------
    def _json(self, value, body: bool) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str | None, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _bytes(self, blob: Blob, body: bool, headers: dict | None = None) -> None:
        start, end = 0, blob.size
        rng = self.headers.get("Range")
        if rng and (m := re.match(r"bytes=(\d+)-(\d*)$", rng)):
            start = int(m.group(1))
            end = int(m.group(2)) + 1 if m.group(2) else blob.size
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{blob.size}")
        else:
            self.send_response(200)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if not body:
            return
        name = blob.path.name
        cut = self.hub.cut_after.pop(name, None) if not rng else None
        rate = self.hub.throttle.get(name)
        with open(blob.path, "rb") as f:
            if cut is None and rate is None:
                self.connection.sendfile(f, start, end - start)
                return
            f.seek(start)
            sent, t0 = 0, time.monotonic()
            while start + sent < end:
                chunk = f.read(min(16 * 1024, end - start - sent))
                if rate:  # hold each chunk back until the rate allows it
                    time.sleep(max(0.0, (sent + len(chunk)) / rate - (time.monotonic() - t0)))
                if cut is not None and sent + len(chunk) > cut:
                    self.wfile.write(chunk[:cut - sent])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)  # the connection drops mid-body
                    return
                self.wfile.write(chunk)
                sent += len(chunk)
