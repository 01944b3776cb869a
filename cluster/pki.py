"""The local control plane's certificates: one CA, the apiserver's serving certificate, client
certificates for each component, and the service-account signing key pair.

Everything is written once into the state directory's `pki/` and reused by later `cluster up`s, so
a kubeconfig handed out earlier keeps working for the life of the state directory.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough for a development machine, short enough that nobody mistakes it for production.
VALIDITY = dt.timedelta(days=365)

# Names the apiserver answers to: in-cluster clients use the `kubernetes` Service's names, but
# without kube-proxy they connect to 127.0.0.1 directly (KUBERNETES_SERVICE_HOST).
APISERVER_DNS_NAMES = [
    "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
]
APISERVER_IPS = ["127.0.0.1", "10.0.0.1"]  # loopback and the `kubernetes` Service's ClusterIP


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


def _write_key(path: Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALIDITY))


class PKI:
    """The certificate files of one state directory (`<state>/pki`)."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.ca = CertPair(directory / "ca.crt", directory / "ca.key")
        self.apiserver = CertPair(directory / "apiserver.crt", directory / "apiserver.key")
        self.sa_key = directory / "sa.key"
        self.sa_pub = directory / "sa.pub"

    def client(self, name: str) -> CertPair:
        return CertPair(self.dir / f"{name}.crt", self.dir / f"{name}.key")

    def ensure(self, clients: dict[str, tuple[str, str | None]]) -> None:
        """Create whatever is missing. `clients` maps a file stem to (user name, group)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if not (self.ca.cert.exists() and self.ca.key.exists()):
            self._make_ca()
        if not self.apiserver.cert.exists():
            self._issue(self.apiserver, _name("kube-apiserver"), server=True)
        for stem, (user, group) in clients.items():
            if not self.client(stem).cert.exists():
                self._issue(self.client(stem), _name(user, group), server=False)
        if not self.sa_key.exists():
            self._make_service_account_keys()

    def _make_ca(self) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        name = _name("adpfleet-local-ca")
        cert = (_builder(name, name, key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        _write_key(self.ca.key, key)
        self.ca.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def _issue(self, pair: CertPair, subject: x509.Name, *, server: bool,
               dns_names: list[str] | None = None, ips: list[str] | None = None) -> None:
        ca_key = serialization.load_pem_private_key(self.ca.key.read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate(self.ca.cert.read_bytes())
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (_builder(subject, ca_cert.subject, key.public_key())
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                  critical=False))
        if server:
            names = [x509.DNSName(n) for n in (dns_names or APISERVER_DNS_NAMES)]
            names += [x509.IPAddress(ipaddress.ip_address(i)) for i in (ips or APISERVER_IPS)]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        _write_key(pair.key, key)
        pair.cert.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))

    def issue_server(self, pair: CertPair, common_name: str, ips: list[str]) -> None:
        """A serving certificate for another loopback server (the node agent's log endpoint)."""
        if not pair.cert.exists():
            self._issue(pair, _name(common_name), server=True, dns_names=["localhost"], ips=ips)

    def _make_service_account_keys(self) -> None:
        # RSA: every Kubernetes client library verifies RS256 service-account tokens.
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        _write_key(self.sa_key, key)
        self.sa_pub.write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
