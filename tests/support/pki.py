"""Certificates and kubeconfigs for the test control plane: a throwaway CA, the apiserver's
serving cert, the admin client cert (system:masters), the ServiceAccount signing key pair.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

# Names and addresses the apiserver's serving certificate is valid for.
SERVER_IPS = ("127.0.0.1", "10.0.0.1")
SERVER_NAMES = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc")


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _key_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _cert(
    subject: x509.Name,
    key: rsa.RSAPrivateKey,
    issuer: x509.Name,
    issuer_key: rsa.RSAPrivateKey,
    *,
    ca: bool = False,
    server_ips: Sequence[str] = (),
    server_names: Sequence[str] = (),
) -> bytes:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server_ips or server_names:
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class Pki:
    """Paths of the files the components read, plus the admin credentials as PEM."""

    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path
    sa_pub: Path
    ca_pem: bytes
    admin_cert_pem: bytes
    admin_key_pem: bytes


def make_pki(directory: Path) -> Pki:
    """A fresh CA and everything signed by it, written under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = _name("rljob-test-ca")
    ca_pem = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
    serving_key = _key()
    serving_pem = _cert(
        _name("kube-apiserver"),
        serving_key,
        ca_name,
        ca_key,
        server_ips=SERVER_IPS,
        server_names=SERVER_NAMES,
    )
    admin_key = _key()
    admin_pem = _cert(_name("admin", "system:masters"), admin_key, ca_name, ca_key)
    sa_key = _key()
    sa_pub_pem = sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    files = {
        "ca.crt": ca_pem,
        "apiserver.crt": serving_pem,
        "apiserver.key": _key_pem(serving_key),
        "sa.key": _key_pem(sa_key),
        "sa.pub": sa_pub_pem,
    }
    for name, data in files.items():
        (directory / name).write_bytes(data)
        (directory / name).chmod(0o600)
    return Pki(
        ca_cert=directory / "ca.crt",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
        ca_pem=ca_pem,
        admin_cert_pem=admin_pem,
        admin_key_pem=_key_pem(admin_key),
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kubeconfig_yaml(server: str, ca_pem: bytes, user_name: str, user: dict[str, str]) -> str:
    """A one-cluster, one-user kubeconfig; `user` is the kubeconfig's user entry."""
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "rljob-test",
                    "cluster": {"server": server, "certificate-authority-data": _b64(ca_pem)},
                }
            ],
            "users": [{"name": user_name, "user": user}],
            "contexts": [
                {"name": user_name, "context": {"cluster": "rljob-test", "user": user_name}}
            ],
            "current-context": user_name,
        }
    )


def admin_kubeconfig_yaml(server: str, pki: Pki) -> str:
    return kubeconfig_yaml(
        server,
        pki.ca_pem,
        "admin",
        {
            "client-certificate-data": _b64(pki.admin_cert_pem),
            "client-key-data": _b64(pki.admin_key_pem),
        },
    )


def token_kubeconfig_yaml(server: str, ca_pem: bytes, user_name: str, token: str) -> str:
    return kubeconfig_yaml(server, ca_pem, user_name, {"token": token})
