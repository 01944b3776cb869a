"""Writing and reading the kubeconfig files of the local cluster.

The user's kubeconfig embeds its certificates (it can be copied anywhere); the components' ones
name the files in `pki/` instead. `load` reads either kind into an `ssl.SSLContext` for the node
agent's own client.
"""

from __future__ import annotations

import base64
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from adpfleet.cluster.pki import CertPair

CONTEXT = "adpfleet-local"


def write(path: Path, server: str, ca: Path, client: CertPair, *, embed: bool) -> None:
    def field(name: str, file: Path) -> dict:
        if embed:
            return {f"{name}-data": base64.b64encode(file.read_bytes()).decode()}
        return {name: str(file)}

    config = {
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "clusters": [{"name": CONTEXT, "cluster": {"server": server, **field("certificate-authority", ca)}}],
        "users": [{"name": CONTEXT, "user": {**field("client-certificate", client.cert),
                                             **field("client-key", client.key)}}],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": CONTEXT}}],
        "current-context": CONTEXT,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    tmp.chmod(0o600)
    tmp.replace(path)


@dataclass(frozen=True)
class Credentials:
    server: str
    ssl_context: ssl.SSLContext


def load(path: Path) -> Credentials:
    """The current context's server and a TLS context with its CA and client certificate."""
    config = yaml.safe_load(path.read_text())
    context = next(c["context"] for c in config["contexts"] if c["name"] == config["current-context"])
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
    user = next(u["user"] for u in config["users"] if u["name"] == context["user"])

    with tempfile.TemporaryDirectory(prefix="adpfleet-kubeconfig-") as tmp:
        def material(section: dict, name: str) -> str:
            if name in section:
                return str(path.parent / section[name])  # relative paths are relative to the file
            file = Path(tmp) / name  # ssl reads files only: embedded data goes through one, briefly
            file.write_bytes(base64.b64decode(section[f"{name}-data"]))
            return str(file)

        ctx = ssl.create_default_context(cafile=material(cluster, "certificate-authority"))
        ctx.load_cert_chain(material(user, "client-certificate"), material(user, "client-key"))
    return Credentials(cluster["server"], ctx)
