"""The webhook over TLS: a real TLS client against a certificate made here (a CA and a server
certificate for 127.0.0.1), the token still required, nothing over plain HTTP, a renewed
certificate picked up without a restart, and unusable files refused at start."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import json
import os
import socket
import ssl
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from adpfleet.cluster.processes import free_port
from adpfleet.cluster.testing import wait_for
from adpfleet.operator.alerts import ALERTS_PATH, AlertReceiver, StaticToken
from adpfleet.operator.httpserver import TlsFiles, start_webhook_server
from adpfleet.operator.inbox import AlertInbox
from adpfleet.operator.main import add_arguments, webhook_tls

TOKEN = "tls-token"
PAYLOAD = {"version": "4", "alerts": [{"status": "firing", "startsAt": "2024-05-01T10:00:00Z", "fingerprint": "f1",
                                       "labels": {"alertname": "AdpfleetServerStalled", "namespace": "prod",
                                                  "fleet": "llama", "pod": "llama-context-0"}}]}


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(tmp: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name("test-ca")).issuer_name(_name("test-ca"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    path = tmp / "ca.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, path


def issue(tmp: Path, ca_key, ca_cert, cn: str) -> tuple[Path, Path, int]:
    """A server certificate for 127.0.0.1 signed by the CA, written as tls.crt / tls.key (the names
    a Secret of type kubernetes.io/tls mounts); its serial number."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("adpfleet-operator.adpfleet-system.svc")]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    crt, pem = tmp / "tls.crt", tmp / "tls.key"
    # write-then-rename, as the kubelet swaps a Secret volume's files
    for path, data in ((crt, cert.public_bytes(serialization.Encoding.PEM)),
                       (pem, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))):
        path.with_suffix(".new").write_bytes(data)
        os.replace(path.with_suffix(".new"), path)
    return crt, pem, cert.serial_number


def served_serial(port: int, ca: Path) -> int:
    """The serial number of the certificate the listener presents now (a fresh handshake)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with ctx.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
            der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


def test_the_webhook_serves_tls_with_the_given_certificate_and_reloads_a_renewed_one(tmp_path):
    ca_key, ca_cert, ca = make_ca(tmp_path)
    crt, key, first = issue(tmp_path, ca_key, ca_cert, "first")
    port = free_port()

    async def scenario():
        inbox = AlertInbox()
        receiver = AlertReceiver(StaticToken(TOKEN), inbox, lambda ns, name: {"llama-context-0"})
        runner = await start_webhook_server("127.0.0.1", port, receiver.routes(), TlsFiles(str(crt), str(key)),
                                            reload_seconds=0.05)
        try:
            url = f"https://127.0.0.1:{port}{ALERTS_PATH}"
            async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(ca))) as client:
                resp = await client.post(url, json=PAYLOAD, headers={"Authorization": f"Bearer {TOKEN}"})
                assert resp.status_code == 202 and resp.json()["queued"] == 1
                assert (await client.post(url, json=PAYLOAD)).status_code == 401  # TLS is no substitute for the token
            async with httpx.AsyncClient(verify=True) as untrusting:  # the system CAs do not know ours
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await untrusting.post(url, json=PAYLOAD)
            async with httpx.AsyncClient() as plain:  # no plain HTTP on the TLS port
                with pytest.raises(httpx.HTTPError):
                    await plain.post(f"http://127.0.0.1:{port}{ALERTS_PATH}", json=PAYLOAD,
                                     headers={"Authorization": f"Bearer {TOKEN}"})
            assert await asyncio.to_thread(served_serial, port, ca) == first

            _, _, second = issue(tmp_path, ca_key, ca_cert, "renewed")  # cert-manager renews the Secret
            await asyncio.to_thread(wait_for, lambda: served_serial(port, ca) == second, timeout=10,
                                    what="the renewed certificate to be served")
            async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(ca))) as client:
                resp = await client.post(url, content=json.dumps(PAYLOAD),
                                         headers={"Authorization": f"Bearer {TOKEN}",
                                                  "Content-Type": "application/json"})
                assert resp.status_code == 202  # a duplicate now, still accepted
        finally:
            await runner.cleanup()
    asyncio.run(scenario())


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--namespace", "x", *argv])


def test_webhook_tls_needs_both_files_and_refuses_unusable_ones_at_start(tmp_path):
    assert webhook_tls(_args()) is None  # no certificate: /alerts stays on the HTTP port
    with pytest.raises(ValueError, match="both --alerts-tls-cert and --alerts-tls-key"):
        webhook_tls(_args("--alerts-tls-cert", "/x/tls.crt"))
    (tmp_path / "tls.crt").write_text("not a certificate")
    (tmp_path / "tls.key").write_text("not a key")
    with pytest.raises(ValueError, match=f"cannot use the webhook certificate {tmp_path}/tls.crt"):
        webhook_tls(_args("--alerts-tls-cert", str(tmp_path / "tls.crt"), "--alerts-tls-key",
                          str(tmp_path / "tls.key")))
    ca_key, ca_cert, _ = make_ca(tmp_path)
    crt, key, _ = issue(tmp_path, ca_key, ca_cert, "ok")
    tls = webhook_tls(_args("--alerts-tls-cert", str(crt), "--alerts-tls-key", str(key), "--alerts-port", "9443"))
    assert tls == TlsFiles(str(crt), str(key))
