"""A session's own certificate authority, for the origins whose requests
get credentials from the policy.

The gateway adds a policy's headers only to requests it reads. Over plain
HTTP it reads them anyway; an https request through the proxy is a CONNECT
tunnel, which for such an origin the gateway ends itself: it answers the
guest's TLS with a certificate for that origin issued by the session's CA,
reads each request, and sends it on over its own, verified TLS to the real
upstream (see _gateway.py). Every other tunnel stays blind.

The CA is made in memory for the session, when its policy first needs it,
and its private key never leaves this process's memory (nor do the leaf
keys: ``ssl`` loads a certificate chain only from a path, so it is handed
one to an anonymous memory file, never a file system). The guest trusts it
through a bundle of the host's CAs plus this one, written to the gateway's
directory, which the guest sees at /run/sandboxns/ca.pem (see
PROXY_TRUST_ENVIRONMENT). It can sign for any name, but only this session
trusts it, and only while the session lives.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ._routing import is_address

BUNDLE_NAME = "ca.pem"
# Where a guest finds the host's own trust, to keep it beside the session CA.
HOST_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
CA_LIFETIME = datetime.timedelta(days=365)
LEAF_LIFETIME = datetime.timedelta(days=7)
# Clocks drift; a certificate valid from a little before now is valid for
# a guest whose clock is behind the host's.
BACKDATE = datetime.timedelta(hours=1)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


class SessionAuthority:
    """One session's CA and the server contexts it makes, one per host."""

    def __init__(self, session_id: str) -> None:
        now = datetime.datetime.now(datetime.UTC)
        self._key = ec.generate_private_key(ec.SECP256R1())
        # A common name has at most 64 characters; a backend's session id is 32.
        self._name = _name(f"sandboxns session {session_id}"[:64])
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + CA_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        # One key for every leaf of the session: making a key is most of
        # what a new host costs.
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._contexts: dict[str, tuple[ssl.SSLContext, datetime.datetime]] = {}

    @property
    def pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def write_bundle(self, directory: Path) -> Path:
        """The guest's trust: the host's CAs, then this one. Written once,
        atomically, into the gateway's directory."""
        host = b""
        for candidate in HOST_BUNDLES:
            try:
                host = Path(candidate).read_bytes()
                break
            except OSError:
                continue
        path = directory / BUNDLE_NAME
        temporary = directory / f".{BUNDLE_NAME}.new"
        temporary.write_bytes(host.rstrip(b"\n") + b"\n" + self.pem)
        temporary.chmod(0o644)
        temporary.replace(path)
        return path

    def server_context(self, host: str) -> ssl.SSLContext:
        """A server-side context presenting a certificate for ``host``."""
        now = datetime.datetime.now(datetime.UTC)
        cached = self._contexts.get(host)
        if cached is not None and cached[1] - now > LEAF_LIFETIME / 2:
            return cached[0]
        expires = now + LEAF_LIFETIME
        alternative = x509.IPAddress(ipaddress.ip_address(host)) if is_address(host) else x509.DNSName(host)
        leaf = (
            x509.CertificateBuilder()
            .subject_name(_name(host))
            .issuer_name(self._name)
            .public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(expires)
            .add_extension(x509.SubjectAlternativeName([alternative]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        chain = leaf.public_bytes(serialization.Encoding.PEM) + self._leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.set_alpn_protocols(["http/1.1"])  # the gateway speaks HTTP/1.1 alone
        memory = os.memfd_create("sandboxns-leaf", os.MFD_CLOEXEC)
        try:
            os.write(memory, chain)
            context.load_cert_chain(f"/proc/self/fd/{memory}")
        finally:
            os.close(memory)
        self._contexts[host] = (context, expires)
        return context
