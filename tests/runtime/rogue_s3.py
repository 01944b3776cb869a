"""A lying S3-compatible store: it speaks enough of the S3 API for `boto3` (path-style
ListObjectsV2, HeadObject, GetObject with Range; signatures are not checked) and lists each object
at whatever size it is told, serves it at whatever rate it is told. What moto, an honest store,
cannot be made to do (loopback only).

    with RogueS3() as store:
        store.put("models", "liar/model.safetensors", data, listed_size=1, rate=2_000)
        os.environ["AWS_ENDPOINT_URL"] = store.url
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape


@dataclass
class RogueObject:
    data: bytes
    listed_size: int  # what the listing says
    rate: float | None  # bytes per second of the body, None for as fast as it goes

    @property
    def etag(self) -> str:
        return hashlib.md5(self.data).hexdigest()


class RogueS3:
    def __init__(self):
        self.objects: dict[tuple[str, str], RogueObject] = {}
        self._server: ThreadingHTTPServer | None = None

    def put(self, bucket: str, key: str, data: bytes, listed_size: int | None = None, rate: float | None = None):
        self.objects[bucket, key] = RogueObject(data, len(data) if listed_size is None else listed_size, rate)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "RogueS3":
        class Handler(_Handler):
            store = self
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="rogue-s3", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: RogueS3

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._object(body=False)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if "list-type" in parse_qs(url.query):
            return self._list(unquote(url.path.strip("/")), parse_qs(url.query).get("prefix", [""])[0])
        self._object(body=True)

    def _list(self, bucket: str, prefix: str) -> None:
        found = sorted((k, o) for (b, k), o in self.store.objects.items() if b == bucket and k.startswith(prefix))
        contents = "".join(f"<Contents><Key>{escape(k)}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified>"
                           f"<ETag>&quot;{o.etag}&quot;</ETag><Size>{o.listed_size}</Size>"
                           "<StorageClass>STANDARD</StorageClass></Contents>" for k, o in found)
        self._send(200, {"Content-Type": "application/xml"}, (
            '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(found)}</KeyCount>"
            f"<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{contents}</ListBucketResult>").encode())

    def _object(self, body: bool) -> None:
        bucket, _, key = unquote(urlsplit(self.path).path).lstrip("/").partition("/")
        obj = self.store.objects.get((bucket, key))
        if obj is None:
            return self._send(404, {"Content-Type": "application/xml"}, b"<Error><Code>NoSuchKey</Code></Error>",
                              body)
        start, end, status, headers = 0, len(obj.data), 200, {}
        if m := re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", "")):
            start, end = int(m.group(1)), min(int(m.group(2)) + 1 if m.group(2) else len(obj.data), len(obj.data))
            status, headers = 206, {"Content-Range": f"bytes {start}-{end - 1}/{len(obj.data)}"}
        headers.update({"ETag": f'"{obj.etag}"', "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT",
                        "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"})
        self._send(status, headers, obj.data[start:end], body, obj.rate)

    def _send(self, status: int, headers: dict, data: bytes, body: bool = True, rate: float | None = None) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not body:
            return
        step = 4096 if rate else len(data) or 1
        t0 = time.monotonic()
        try:
            for sent in range(0, len(data), step):
                if rate:  # hold each piece back until the rate allows it
                    time.sleep(max(0.0, (sent + step) / rate - (time.monotonic() - t0)))
                self.wfile.write(data[sent:sent + step])
        except (BrokenPipeError, ConnectionResetError):  # the client gave up on it
            pass
