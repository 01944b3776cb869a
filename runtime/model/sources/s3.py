"""s3://BUCKET[/PREFIX] with `boto3`.

Credentials come from the usual AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION, a profile or an instance role); AWS_ENDPOINT_URL (or
AWS_ENDPOINT_URL_S3) points at an S3-compatible store such as MinIO or Ceph, addressed path-style.
Each object lands under its own name once complete (boto3 writes a temporary file and renames
it), so a later attempt fetches only what is missing. One file is one stream (boto3's own threads
would keep a process that gave up on a stalled fetch from exiting); files run in parallel instead.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from adpfleet.model_uri import (ACCESS_DENIED, BUCKET_NOT_FOUND, INVALID_CREDENTIALS, OBJECT_NOT_FOUND,
                                SOURCE_UNREACHABLE, ModelSourceError, ModelURI)

_CREDENTIALS = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                "InvalidClientTokenId", "AuthorizationHeaderMalformed")


class S3Source:
    def __init__(self, uri: ModelURI):
        import boto3
        from botocore.config import Config

        self.uri = uri
        self.endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        config = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10, read_timeout=60,
                        s3={"addressing_style": "path"} if self.endpoint else {})
        # a new session: credentials are read from the environment now, not cached from an earlier client
        self.client = boto3.session.Session().client("s3", endpoint_url=self.endpoint, config=config)
        self.prefix = uri.path + "/" if uri.path else ""
        self.revision: str | None = None  # S3 has no revisions; the marker keeps the ETags instead
        self.etags: dict[str, str] = {}

    def list(self) -> dict[str, int]:
        listing: dict[str, int] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.uri.name, Prefix=self.prefix):
            for obj in page.get("Contents", ()):
                name = obj["Key"][len(self.prefix):]
                if name and not name.endswith("/"):
                    listing[name] = obj["Size"]
                    self.etags[name] = obj.get("ETag", "").strip('"')
        if not listing:
            raise ModelSourceError(OBJECT_NOT_FOUND, f"no object under {self.uri.uri}")
        return listing

    def fetch(self, name: str, dest: Path) -> None:
        """One object into `dest` (which `transfer.fetch_files` watches)."""
        from boto3.s3.transfer import TransferConfig

        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        self.client.download_file(self.uri.name, self.prefix + name, str(target),
                                  Config=TransferConfig(use_threads=False))

    @contextmanager
    def errors(self):
        from botocore.exceptions import (ClientError, ConnectTimeoutError, EndpointConnectionError,
                                         NoCredentialsError, PartialCredentialsError, ReadTimeoutError)

        where = f"s3://{self.uri.name}" + (f" at {self.endpoint}" if self.endpoint else "")
        try:
            yield
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code == "NoSuchBucket":
                raise ModelSourceError(BUCKET_NOT_FOUND, f"bucket {where} does not exist") from None
            if code in _CREDENTIALS:
                raise ModelSourceError(INVALID_CREDENTIALS, f"{where} refused the credentials ({code}): check "
                                                            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") from None
            if code in ("AccessDenied", "403", "AllAccessDisabled"):
                raise ModelSourceError(ACCESS_DENIED, f"{where}: the credentials are not allowed to read "
                                                      f"{self.uri.uri} ({code})") from None
            if code in ("NoSuchKey", "404"):
                raise ModelSourceError(OBJECT_NOT_FOUND, f"{self.uri.uri}: an object vanished while it was "
                                                         f"fetched ({code})") from None
            raise ModelSourceError(SOURCE_UNREACHABLE, f"{where} answered {code}: {e}") from None
        except (NoCredentialsError, PartialCredentialsError) as e:
            raise ModelSourceError(INVALID_CREDENTIALS, f"{where}: {e} (set AWS_ACCESS_KEY_ID and "
                                                        "AWS_SECRET_ACCESS_KEY)") from None
        except (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError) as e:
            raise ModelSourceError(SOURCE_UNREACHABLE, f"{where}: {e}") from None
