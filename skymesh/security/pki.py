"""Mesh identity: the mesh CA, per-component certificates and the mTLS gRPC plumbing.

Every gRPC channel of the mesh (balancer<->balancer heartbeats, balancer->controller) and
every forwarded request between balancers (HTTPS to the peer listener, :func:`peer_tls`) is
mutual TLS under one mesh CA. A certificate names what it is in a SAN URI:

* ``spiffe://skymesh/region/<region>``: the balancer of ``<region>`` (also the DNS SAN
  ``<region>.balancer.skymesh``, which a dialer checks as the TLS target name);
* ``spiffe://skymesh/controller`` (DNS SAN ``controller.skymesh``);
* ``spiffe://skymesh/admin``: an operator's client (status tools), no server name.

Servers read the caller's identity from the verified certificate (:func:`peer_identity`);
dialers pin the identity of who they dial through the target name, so a balancer that
dials region R's address only talks to a process holding R's key, whatever the address
resolves to (a delay proxy, a moved IP).

:func:`generate_mesh_pki` writes a CA and every component's key and certificate (what
``skymesh up`` does on first run, and what the tests use); for a deployed mesh,
``skymesh pki issue`` (skymesh/security/pki_cli.py) runs it once, offline, adds the peer and admin
tokens, and terraform/modules/secrets ships each host only its files.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from skymesh.config import ConfigError

if TYPE_CHECKING:
    from skymesh.config import MeshConfig

TRUST_DOMAIN = "skymesh"
CONTROLLER_IDENTITY = f"spiffe://{TRUST_DOMAIN}/controller"
ADMIN_IDENTITY = f"spiffe://{TRUST_DOMAIN}/admin"
CONTROLLER_SERVER_NAME = f"controller.{TRUST_DOMAIN}"
CERT_VALID_DAYS = 825


def balancer_identity(region: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/region/{region}"


def balancer_server_name(region: str) -> str:
    """The DNS SAN of region's balancer certificate: the TLS target name peers verify."""
    return f"{region}.balancer.{TRUST_DOMAIN}"


def region_of_identity(identity: str | None) -> str | None:
    """The region a balancer identity names; None for any other identity."""
    prefix = f"spiffe://{TRUST_DOMAIN}/region/"
    if identity is not None and identity.startswith(prefix):
        return identity[len(prefix):]
    return None


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ----------------------------------------------------------------------------- credentials


@dataclass(frozen=True)
class Credentials:
    """One component's PEM material: the mesh CA, its certificate and its private key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def server_credentials(self) -> grpc.ServerCredentials:
        # require_client_auth: a caller without a certificate from the mesh CA fails the
        # handshake; no RPC handler runs for it
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)


def secure_channel(address: str, creds: Credentials, server_name: str,
                   options: Iterable[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An mTLS channel to ``address`` that only accepts a server whose certificate has the
    DNS SAN ``server_name`` (the identity dialed, not the host name of the address)."""
    return grpc.aio.secure_channel(address, creds.channel_credentials(),
                                   options=[("grpc.ssl_target_name_override", server_name), *options])


def peer_identity(context: Any) -> str | None:
    """The SPIFFE URI of the verified client certificate of a gRPC call (None: no TLS
    client certificate). grpc has already verified the chain against the mesh CA."""
    auth = context.auth_context() or {}
    pems = auth.get("x509_pem_cert") or []
    if not pems:
        return None
    cert = x509.load_pem_x509_certificate(pems[0])
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith("spiffe://")]
    return uris[0] if len(uris) == 1 else None


def load_credentials(cfg: MeshConfig, component: str) -> Credentials | None:
    """``component``: "controller", "admin" or a region name (its balancer). None when the
    config has no ``tls`` section. A missing file is a ConfigError naming its key."""
    tls = cfg.tls
    if tls is None:
        return None
    if component == "controller":
        files, where = tls.controller, "tls.controller"
    elif component == "admin":
        if tls.admin is None:
            raise ConfigError("tls.admin", "is required for an admin client")
        files, where = tls.admin, "tls.admin"
    else:
        if component not in tls.balancers:
            raise ConfigError("tls.balancers", f"no certificate for region {component!r}")
        files, where = tls.balancers[component], f"tls.balancers.{component}"

    def read(path: str, key: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(key, f"cannot read {path}: {e.strerror}") from None

    return Credentials(read(tls.ca_cert, "tls.ca_cert"), read(files.cert, f"{where}.cert"),
                       read(files.key, f"{where}.key"))


@dataclass(frozen=True)
class PeerTls:
    """The ``ssl`` contexts of one balancer's peer forwards (HTTPS between balancers):
    ``server`` for its peer listener (a client certificate from the mesh CA is required),
    ``client`` for its forwards (presents its own certificate, verifies the peer's against
    the mesh CA; the name checked is the dialed region's :func:`balancer_server_name`,
    given per connection as ``server_hostname``)."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def peer_tls(cfg: MeshConfig, region: str) -> PeerTls | None:
    """The TLS contexts of ``region``'s balancer for peer forwards, from the same files as
    its gRPC credentials (:func:`load_credentials`); None when the config has no ``tls``
    section. A missing or unusable file is a ConfigError naming its key."""
    if load_credentials(cfg, region) is None:  # also: every file is readable
        return None
    assert cfg.tls is not None
    files = cfg.tls.balancers[region]
    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED
        for ctx in (server, client):
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # both ends are skymesh
            ctx.load_verify_locations(cafile=cfg.tls.ca_cert)
            ctx.load_cert_chain(files.cert, files.key)
        server.verify_mode = ssl.CERT_REQUIRED  # no certificate from the mesh CA: no handshake
    except (ssl.SSLError, OSError) as e:
        raise ConfigError(f"tls.balancers.{region}", f"cannot use the certificate or key: {e}") from None
    return PeerTls(server, client)


def identity_of_peercert(cert: dict[str, Any] | None) -> str | None:
    """The SPIFFE URI of a verified TLS peer certificate as ``ssl`` decodes it
    (``SSLObject.getpeercert()``); None: no certificate, or not exactly one SPIFFE URI."""
    if not cert:
        return None
    uris = [v for k, v in cert.get("subjectAltName", ()) if k == "URI" and v.startswith("spiffe://")]
    return uris[0] if len(uris) == 1 else None


def require_credentials_off_loopback(host: str, creds: object | None, what: str, listener: str = "gRPC") -> None:
    """No default secrets: gRPC (or the peer listener) off loopback needs the mesh's
    certificates."""
    if creds is None and not is_loopback_host(host):
        raise ConfigError("tls", f"{what} binds {listener} to {host}, which is not loopback: set the config's "
                                 "tls section (ca_cert, controller, balancers.<region>; see docs/deploy.md)")


# ----------------------------------------------------------------------------- generation


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def generate_ca(common_name: str = "skymesh mesh CA") -> tuple[bytes, bytes]:
    """A new self-signed CA: (key PEM, certificate PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=CERT_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


def issue_certificate(ca_key_pem: bytes, ca_cert_pem: bytes, identity: str, common_name: str,
                      server_name: str | None) -> tuple[bytes, bytes]:
    """A leaf certificate for ``identity`` (SAN URI) signed by the CA: (key PEM, cert PEM).
    ``server_name``: the DNS SAN dialers verify (None: a client-only certificate)."""
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity)]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if server_name is not None:
        sans.append(x509.DNSName(server_name))
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=CERT_VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


def write_private(path: Path, data: bytes) -> None:
    # created 0600 from the start: a key is never readable by others, not even briefly
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def generate_mesh_pki(directory: str | Path, regions: Iterable[str], *, reuse: bool = True) -> dict[str, Any]:
    """The mesh CA and a key+certificate for the controller, an admin client and every
    region's balancer, under ``directory`` (files 0600). Returns the config's ``tls``
    section naming them. With ``reuse``, files already there are kept (the CA survives
    restarts, so running balancers and new ones trust each other)."""
    d = Path(directory).resolve()
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    ca_key_path, ca_cert_path = d / "ca.key", d / "ca.crt"
    if reuse and ca_key_path.exists() and ca_cert_path.exists():
        ca_key, ca_cert = ca_key_path.read_bytes(), ca_cert_path.read_bytes()
    else:
        ca_key, ca_cert = generate_ca()
        write_private(ca_key_path, ca_key)
        write_private(ca_cert_path, ca_cert)
        reuse = False  # a new CA: every leaf must be issued again

    def leaf(name: str, identity: str, common_name: str, server_name: str | None) -> dict[str, str]:
        cert_path, key_path = d / f"{name}.crt", d / f"{name}.key"
        if not (reuse and cert_path.exists() and key_path.exists()):
            key, cert = issue_certificate(ca_key, ca_cert, identity, common_name, server_name)
            write_private(key_path, key)
            write_private(cert_path, cert)
        return {"cert": str(cert_path), "key": str(key_path)}

    return {
        "ca_cert": str(ca_cert_path),
        "controller": leaf("controller", CONTROLLER_IDENTITY, "controller", CONTROLLER_SERVER_NAME),
        "admin": leaf("admin", ADMIN_IDENTITY, "admin", None),
        "balancers": {
            r: leaf(f"balancer-{r}", balancer_identity(r), f"balancer.{r}", balancer_server_name(r))
            for r in regions
        },
    }
