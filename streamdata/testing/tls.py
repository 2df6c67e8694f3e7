"""A private certificate authority on loopback: :class:`TLSFront`, a TLS-terminating front signed
by a private CA made by :func:`make_certificates`. End-to-end tests use it to check that the
package works with a private CA. ``cryptography`` is imported by :func:`make_certificates`
when certificates are made. The rules of every loop server: :mod:`streamdata.testing._loop`.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import shutil
import ssl
import tempfile
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from streamdata.errors import BackendMissingError
from streamdata.testing._loop import (
    _authority,
    _LoopServer,
    _splice,
)
from streamdata.testing._process import (
    _INSTALL_HINT,
    ServerError,
)

__all__ = ["CertificatePaths", "TLSFront", "make_certificates"]

DEFAULT_NAMES = ("127.0.0.1", "localhost")  # what a TLSFront's certificate always names


@dataclass(frozen=True)
class CertificatePaths:
    """PEM files: the test CA's certificate (what clients trust), and the server's
    certificate and unencrypted private key (what a TLS server loads)."""

    ca_file: str
    cert_file: str
    key_file: str


def make_certificates(directory: str | os.PathLike[str], names: Iterable[str], *,
                      days: int = 30) -> CertificatePaths:
    """Make a certificate authority and a server certificate it signs for ``names`` (DNS
    names and IP addresses, as subjectAltName entries), written to ``directory`` as
    ``ca.pem``, ``server.pem`` and ``server.key``. A client that trusts ``ca.pem`` verifies
    the server under any of ``names``; nothing else trusts it. Keys are EC P-256 (fast to make)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as err:
        raise BackendMissingError(f"cryptography is not installed: {_INSTALL_HINT}") from err
    names = list(dict.fromkeys(names))
    if not names:
        raise ValueError("make_certificates needs at least one name")
    alt_names: list[x509.GeneralName] = []
    for name in names:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt_names.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=days)

    def usage(*, sign: bool) -> x509.KeyUsage:
        return x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                             data_encipherment=False, key_agreement=not sign, key_cert_sign=sign,
                             crl_sign=sign, encipher_only=False, decipher_only=False)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "streamdata tests"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "streamdata test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(usage(sign=True), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage(sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    paths = CertificatePaths(str(folder / "ca.pem"), str(folder / "server.pem"), str(folder / "server.key"))
    Path(paths.ca_file).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    Path(paths.cert_file).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    descriptor = os.open(paths.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(key_pem)
    return paths


def _remove_tree(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not from a forked child exiting: the directory is its parent's
        shutil.rmtree(path, ignore_errors=True)


class TLSFront(_LoopServer):
    """A TLS-terminating front on a loopback port: takes TLS (HTTP/1.1 by ALPN) with a
    certificate for ``127.0.0.1``, ``localhost`` and ``names``, and splices the decrypted
    bytes to the plain ``upstream`` (``"host:port"``, or an ``http://host:port`` URL such as
    an ``endpoint_url``); one upstream connection per client connection, no HTTP parsing.

    The certificates (``ca_file``, ``cert_file``, ``key_file``) are made by ``start()`` in a
    temporary directory kept until the front is garbage-collected, so that a restart keeps
    them; pass ``certificates`` (from :func:`make_certificates`) to use one CA for several
    servers. ``connections`` counts completed handshakes.
    """

    _kind = "tls-front"

    def __init__(self, upstream: str | tuple[str, int], names: Iterable[str] = (), *,
                 certificates: CertificatePaths | None = None, host: str = "127.0.0.1",
                 port: int | None = None, timeout: float = 60.0) -> None:
        super().__init__(host, port, timeout)
        if isinstance(upstream, tuple):
            self.upstream_host, self.upstream_port = upstream[0], int(upstream[1])
        elif "://" in upstream:
            parts = urlsplit(upstream)
            if parts.scheme.lower() != "http" or not parts.hostname:
                raise ValueError(f"upstream must be host:port or an http:// URL, not {upstream!r}")
            self.upstream_host, self.upstream_port = parts.hostname, parts.port or 80
        else:
            self.upstream_host, self.upstream_port = _authority(upstream)
        self.names = list(dict.fromkeys([*DEFAULT_NAMES, *names]))
        self._certificates = certificates

    @property
    def url(self) -> str:
        host, port = self._address()
        return f"https://{host}:{port}"

    @property
    def certificates(self) -> CertificatePaths:
        if self._certificates is None:
            raise ServerError("TLSFront is not started (start() makes its certificates)")
        return self._certificates

    @property
    def ca_file(self) -> str:
        return self.certificates.ca_file

    @property
    def cert_file(self) -> str:
        return self.certificates.cert_file

    @property
    def key_file(self) -> str:
        return self.certificates.key_file

    def ssl_context(self) -> ssl.SSLContext:
        """A client context that trusts this front's CA (and nothing else)."""
        return ssl.create_default_context(cafile=self.ca_file)

    def _ssl_context(self) -> ssl.SSLContext:
        if self._certificates is None:
            directory = tempfile.mkdtemp(prefix="streamdata-tls-")
            weakref.finalize(self, _remove_tree, directory, os.getpid())
            self._certificates = make_certificates(directory, self.names)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self._certificates.cert_file, self._certificates.key_file)
        context.set_alpn_protocols(["http/1.1"])
        return context

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await self._open(self.upstream_host, self.upstream_port)
        except OSError:
            return  # closing the client's connection is the answer: no HTTP is spoken here
        try:
            await _splice(reader, writer, up_reader, up_writer, self.timeout)
        finally:
            self._release(up_writer)

    def __repr__(self) -> str:
        return (f"TLSFront(port={self.port}, upstream={self.upstream_host}:{self.upstream_port}, "
                f"names={self.names})")
