"""The model source: a URI (adpfleet/model_uri.py), the rules the API server checks it by, and what
fetching it needs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, ClassVar

from pydantic import Field

from adpfleet.contract.name_patterns import DNS_LABEL, HF_NAME, HF_REVISION, S3_BUCKET
from adpfleet.model_uri import ModelURI, ModelURIError, parse_model_uri
from adpfleet.operator.resource.cel import CelRule, KubeModel, cel_checked
from adpfleet.operator.resource.kube_types import DNS_SUBDOMAIN, LocalObjectReference, Quantity, SecretKeyRef


@dataclass(frozen=True)
class URIRule:
    """One part of the model-source URI grammar as RE2 regular expressions, for the API server:
    where the URI matches `applies`, it must match every `require` and none of `forbid` (CEL's
    `matches` searches, as `re.search` does). The Python twin is `parse_model_uri` itself: the rule
    fails when parsing fails at this `part`. tests/operator/test_models.py keeps the expressions and
    the parser in agreement over a catalogue of URIs."""
    part: str
    message: str
    applies: str | None
    require: tuple[str, ...] = ()
    forbid: tuple[str, ...] = ()

    def cel(self) -> str:
        def matches(rx: str) -> str:
            assert "'" not in rx
            return "self.matches('" + rx.replace("\\", "\\\\") + "')"
        terms = " && ".join([matches(r) for r in self.require] + [f"!{matches(r)}" for r in self.forbid])
        return f"!{matches(self.applies)} || ({terms})" if self.applies else terms

    def holds(self, text: str) -> bool:
        """What the API server's CEL rule says about `text` (the regular expressions, in Python)."""
        if self.applies and not re.search(self.applies, text):
            return True
        return all(re.search(r, text) for r in self.require) and not any(re.search(r, text) for r in self.forbid)

    def check(self, text: str) -> bool:
        """The Python twin: the parser does not refuse `text` for this part."""
        if self.applies and not re.search(self.applies, text):
            return True
        try:
            parse_model_uri(text)
        except ModelURIError as e:
            return e.part != self.part
        return True

    def cel_rule(self) -> CelRule:
        return CelRule(self.cel(), self.message, None, self.check)


URI_RULES = (
    URIRule("the URI", "must not contain whitespace or control characters", None, forbid=(r"[\x00-\x20]",)),
    URIRule("scheme", "the scheme must be hf://, s3://, pvc:// or file:// (or give a model directory or a built-in "
                      "name: tiny, tiny-dense)",
            "^[A-Za-z][A-Za-z0-9+.-]*://", require=("^(hf|s3|pvc|file)://",)),
    URIRule("repo", "hf:// needs a repository, hf://ORG/REPO[@REVISION]: letters, digits, '-', '_' and '.', at most "
                    "96 each, no '--' or '..'",
            "^hf://", require=(f"^hf://{HF_NAME}(/{HF_NAME})?(@|$)",), forbid=("^hf://[^@]*(--|[.][.])",)),
    URIRule("revision", "the revision after '@' must be a branch, tag or commit",
            "^hf://[^@]*@", require=(f"^hf://[^@]*@{HF_REVISION}$",),
            forbid=("^hf://[^@]*@.*[.][.]", "/$")),
    URIRule("bucket", "s3:// needs a bucket name, s3://BUCKET[/PREFIX]: 3-63 lowercase letters, digits, dots and "
                      "hyphens",
            "^s3://", require=(f"^s3://{S3_BUCKET}(/|$)",), forbid=("^s3://[^/]*[.][.]",)),
    URIRule("prefix", "the S3 prefix must not contain '.' or '..' segments",
            "^s3://", forbid=("^s3://[^/]*/(.*/)?[.][.]?(/|$)",)),
    URIRule("claim", "pvc:// needs a PersistentVolumeClaim name, pvc://CLAIM[/PATH]: a lowercase DNS subdomain "
                     "(letters, digits, '-' and '.')",
            "^pvc://", require=(f"^pvc://{DNS_LABEL}([.]{DNS_LABEL})*(/|$)", "^pvc://[^/]{1,253}(/|$)")),
    URIRule("path", "the path inside the claim must not contain '.' or '..' segments",
            "^pvc://", forbid=("^pvc://[^/]*/(.*/)?[.][.]?(/|$)",)),
    URIRule("path", "file:// needs an absolute path (file:///DIR)", "^file://", require=("^file:///",)),
)
ModelURIText = Annotated[str, Field(min_length=1, max_length=512), *cel_checked(*(r.cel_rule() for r in URI_RULES))]
_SOURCE = "(has(self.uri) ? self.uri : (has(self.name) ? self.name : ''))"  # CEL: the URI, whichever field has it


class ModelCache(KubeModel):
    """Where hf:// and s3:// models are downloaded before a server starts: an emptyDir of each pod, or
    a PersistentVolumeClaim the fleet's servers share (downloaded once, kept across restarts)."""
    size_limit: Quantity | None = Field(None, description="Size limit of each pod's emptyDir cache, e.g. '50Gi' (a "
                                                          "download that does not fit fails with DiskFull).")
    claim_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                                   description="A PersistentVolumeClaim in the fleet's namespace used as the cache by "
                                               "every server of the fleet instead of an emptyDir (ReadWriteMany when "
                                               "servers run on several nodes).")
    cel_rules: ClassVar = (
        CelRule("!has(self.sizeLimit) || !has(self.claimName)",
                "sizeLimit is the emptyDir's; a claim's size is its own (set one of sizeLimit and claimName)",
                ".sizeLimit", lambda c: c.size_limit is None or c.claim_name is None),
    )


class ModelSource(KubeModel):
    """What the servers load, and what fetching it needs (docs/operator.md, Model sources)."""
    uri: ModelURIText | None = Field(None, description="The model: hf://ORG/REPO[@REVISION] (Hugging Face Hub), "
                                                       "s3://BUCKET/PREFIX, pvc://CLAIM/PATH (mounted read-only), a "
                                                       "model directory inside the image, or a built-in name ('tiny', "
                                                       "'tiny-dense'). hf:// and s3:// are downloaded by an init "
                                                       "container into the cache before the server starts.")
    name: ModelURIText | None = Field(None, description="The older spelling of uri (set one of them).")
    served_name: str | None = Field(None, min_length=1, max_length=256, pattern=r"^\S+$",
                                    description="Model id the OpenAI API reports and accepts; default: the "
                                                "repository's name (else the last segment of the path).")
    endpoint: str | None = Field(None, max_length=1024, pattern=r"^https?://[^\s/?#]+(/\S*)?$",
                                 description="Where the source is served from: a Hugging Face Hub mirror for hf:// "
                                             "(HF_ENDPOINT), an S3-compatible store such as MinIO or Ceph for s3:// "
                                             "(AWS_ENDPOINT_URL).")
    token_secret_ref: SecretKeyRef | None = Field(None, description="Secret key given to the download as HF_TOKEN "
                                                                    "(gated or private Hugging Face repositories).")
    credentials_secret_ref: LocalObjectReference | None = Field(
        None, description="s3://: a Secret with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and, if "
                          "present, AWS_SESSION_TOKEN and AWS_REGION), given to the download as those variables.")
    cache: ModelCache = Field(default_factory=ModelCache, description="Where downloads land.")
    cel_rules: ClassVar = (
        CelRule("has(self.uri) != has(self.name)", "set exactly one of uri and name (name is the older spelling of "
                                                   "uri)", ".uri", lambda m: (m.uri is None) != (m.name is None)),
        CelRule(f"!has(self.endpoint) || {_SOURCE}.startsWith('hf://') || {_SOURCE}.startsWith('s3://')",
                "endpoint is for hf:// and s3:// sources", ".endpoint",
                lambda m: m.endpoint is None or m.source.startswith(("hf://", "s3://"))),
        CelRule(f"!has(self.credentialsSecretRef) || {_SOURCE}.startsWith('s3://')",
                "credentialsSecretRef is for s3:// sources (hf:// takes tokenSecretRef)", ".credentialsSecretRef",
                lambda m: m.credentials_secret_ref is None or m.source.startswith("s3://")),
    )

    @property
    def source(self) -> str:
        """The model URI, from whichever of uri and name is set."""
        return self.uri or self.name or ""

    @property
    def parsed(self) -> ModelURI:
        return parse_model_uri(self.source)
