"""hf://ORG/REPO[@REVISION] with the `huggingface_hub` client.

The revision is resolved to a commit once (`model_info`), and every file is fetched at that
commit, so a branch moving during the download cannot mix two versions; the commit is reported
and kept in the cache marker. HF_TOKEN authenticates (gated and private repositories), HF_ENDPOINT
points at a mirror. The client resumes a dropped connection with a Range request; files already
complete in the fill directory are not fetched again by a later attempt.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from adpfleet.model_uri import (ACCESS_DENIED, REPOSITORY_NOT_FOUND, REVISION_NOT_FOUND, SOURCE_UNREACHABLE,
                                UNAUTHORIZED, UNSAFE_FILE_NAME, ModelSourceError, ModelURI)


class HubSource:
    def __init__(self, uri: ModelURI):
        from huggingface_hub import HfApi
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # progress goes to the log (progress.py), not as terminal bars
        self.uri = uri
        self.endpoint = os.environ.get("HF_ENDPOINT") or None
        self.token = os.environ.get("HF_TOKEN") or None
        self.api = HfApi(endpoint=self.endpoint, token=self.token)
        self.revision: str | None = None  # the commit, once listed

    def list(self) -> dict[str, int]:
        """The repository's files and sizes at the revision; resolves the revision to a commit."""
        info = self.api.model_info(self.uri.name, revision=self.uri.revision, files_metadata=True)
        self.revision = info.sha
        return {s.rfilename: s.size or 0 for s in info.siblings or ()}

    def fetch(self, name: str, dest: Path) -> None:
        """One file at the listed commit into `dest` (which `transfer.fetch_files` watches)."""
        from huggingface_hub import hf_hub_download

        hf_hub_download(self.uri.name, name, revision=self.revision, local_dir=dest, endpoint=self.endpoint,
                        token=self.token)

    @contextmanager
    def errors(self):
        """The client's exceptions as a ModelSourceError with its reason."""
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                            RevisionNotFoundError)

        repo = self.uri.name
        auth = "with the HF_TOKEN given" if self.token else "without a token (set HF_TOKEN)"
        try:
            yield
        except GatedRepoError as e:
            if e.response is not None and e.response.status_code == 403:
                raise ModelSourceError(ACCESS_DENIED, f"{repo} is gated and the HF_TOKEN given has no access "
                                                      "to it: accept its terms on the Hub with that account") from None
            raise ModelSourceError(UNAUTHORIZED, f"{repo} is gated: it cannot be downloaded {auth}") from None
        except RepositoryNotFoundError:
            raise ModelSourceError(REPOSITORY_NOT_FOUND, f"repository {repo} not found at "
                                                         f"{self.endpoint or 'the Hugging Face Hub'} (or it is "
                                                         f"private and was asked for {auth})") from None
        except RevisionNotFoundError:
            raise ModelSourceError(REVISION_NOT_FOUND, f"{repo} has no revision {self.uri.revision!r} "
                                                       "(a branch, tag or commit)") from None
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status == 401:
                raise ModelSourceError(UNAUTHORIZED, f"{repo}: the Hub refused the request {auth}") from None
            if status == 403:
                raise ModelSourceError(ACCESS_DENIED, f"{repo}: the HF_TOKEN given is not allowed this "
                                                      "repository") from None
            raise ModelSourceError(SOURCE_UNREACHABLE, f"{repo}: the Hub answered {status}: {e}") from None
        except ValueError as e:  # the client's own refusal of a file name it will not write
            if "Invalid filename" not in str(e):
                raise
            raise ModelSourceError(UNSAFE_FILE_NAME, f"{repo}: the hub lists a file huggingface_hub refuses to "
                                                     f"write ({e})") from None
