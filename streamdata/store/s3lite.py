"""S3 without botocore where the storage options allow it: SigV4 query signing and a listing.

LITE-S3: with an explicit endpoint and static credentials (or ``anon``) in the storage options,
everything streamdata asks of S3 is a GET: a presigned ``get_object`` for the bytes, a
presigned ``ListObjectsV2`` for sizes. Both are signed here (standard library only: hashlib,
hmac), so neither the constructor nor a DataLoader worker imports s3fs, aiobotocore or
botocore (0.3-0.5 s on a 2-core machine), builds a botocore client (0.1-0.2 s: endpoint rules)
or sends anything but the one listing request. Any other option (a profile, a session,
requester-pays, virtual addressing, ...) keeps the botocore path, and so does a listing this
signer cannot make (a 4xx other than 404: a region or signature it got wrong; the botocore
path then gives its usual answer). Path-style addressing: ``{endpoint}/{bucket}/{key}``.

Proxies and certificates (``network``): a request goes through the forward proxy the options or
the environment name for the endpoint (absolute-form for http, a ``CONNECT`` tunnel for
https) and verifies TLS against the bundle they name.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from typing import Any

from streamdata.errors import ProxyAuthError, ProxyError
from streamdata.store.network import Network, network_for
from streamdata.store.session import connect_error

__all__ = ["ENV_NAMES", "LiteS3", "LiteUnsupported"]

_TOP = {"key", "secret", "token", "anon", "endpoint_url", "client_kwargs", "config_kwargs",
        "skip_instance_cache", "use_listings_cache", "proxies", "verify"}
_CLIENT = {"endpoint_url", "region_name", "verify"}
_CONFIG = {"connect_timeout", "read_timeout", "retries", "max_pool_connections", "s3", "proxies"}
_REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")
_PROFILE_ENV = ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_DEFAULT_PROFILE")  # a region may hide there
ENV_NAMES = _REGION_ENV + _PROFILE_ENV  # what ``from_options``'s ``env`` holds: a botocore client's reads
_UNSIGNED = "UNSIGNED-PAYLOAD"


class LiteUnsupported(Exception):
    """This signer cannot make the request: use the botocore path instead."""


def _local(tag: str) -> str:
    """An XML tag without its namespace (S3 sends one; some S3-compatible servers do not)."""
    return tag.rsplit("}", 1)[-1]


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def _quote(text: str, safe: str = "-_.~") -> str:
    return urllib.parse.quote(text, safe=safe)


class LiteS3:
    """Signs S3 GETs for one endpoint, region and set of static credentials (or none)."""

    def __init__(self, endpoint: str, region: str, key: str | None = None, secret: str | None = None,
                 token: str | None = None, *, network: Network | None = None) -> None:
        parts = urllib.parse.urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise LiteUnsupported(f"endpoint {endpoint!r}")
        default = {"http": 80, "https": 443}[parts.scheme]
        self.scheme = parts.scheme
        self.host = parts.hostname if parts.port in (None, default) else f"{parts.hostname}:{parts.port}"
        if ":" in parts.hostname:  # an IPv6 literal
            self.host = f"[{parts.hostname}]" + self.host[len(parts.hostname):]
        self.conn_key = (parts.scheme, parts.hostname, parts.port or default)  # as http1.Pool keys it
        self.base_path = parts.path.rstrip("/")
        self.region = region
        self.ssl_context: Any = None  # https: None, the network's
        self.network = network or Network(None, protocol="s3")
        self.proxy = self.network.proxy(f"{self.scheme}://{self.host}")  # None: direct
        self._key, self._secret, self._token = key, secret, token

    def __repr__(self) -> str:  # never the secret
        return f"LiteS3({self.scheme}://{self.host}, region={self.region!r})"

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None, env: Mapping[str, str | None]) -> LiteS3 | None:
        """A signer for these storage options, or ``None`` where only botocore knows what they mean.
        ``env``: the AWS environment variables a botocore client would read (region, profile)."""
        options = dict(options or {})
        client = dict(options.get("client_kwargs") or {})
        config = dict(options.get("config_kwargs") or {})
        s3 = config.get("s3") or {}
        if (set(options) - _TOP or set(client) - _CLIENT or set(config) - _CONFIG
                or not isinstance(s3, Mapping) or set(s3) - {"addressing_style"}
                or s3.get("addressing_style", "path") not in ("path", "auto")):
            return None
        endpoint = options.get("endpoint_url") or client.get("endpoint_url")
        anon = bool(options.get("anon"))
        key, secret = options.get("key"), options.get("secret")
        if not isinstance(endpoint, str) or not (anon or (isinstance(key, str) and isinstance(secret, str))):
            return None
        region = client.get("region_name") or next((env[n] for n in _REGION_ENV if env.get(n)), None)
        if region is None:
            if any(env.get(n) for n in _PROFILE_ENV):
                return None
            region = "us-east-1"
        try:
            return cls(endpoint, str(region), None if anon else key, None if anon else secret,
                       None if anon else options.get("token"), network=network_for(options, "s3"))
        except LiteUnsupported:
            return None

    # ---- signing --------------------------------------------------------------------------

    def url(self, bucket: str, key: str = "", query: Mapping[str, str] | None = None, *,
            expires: int = 3600, now: datetime.datetime | None = None) -> str:
        """A presigned GET URL (SigV4 query authentication) of ``/bucket/key?query``."""
        path = f"{self.base_path}/{bucket}" + (f"/{key}" if key else "")
        canonical_uri = _quote(path, safe="/-_.~")
        params = dict(query or {})
        if self._key is not None:
            now = now or datetime.datetime.now(datetime.UTC)
            stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
            scope = f"{day}/{self.region}/s3/aws4_request"
            params.update({"X-Amz-Algorithm": "AWS4-HMAC-SHA256", "X-Amz-Credential": f"{self._key}/{scope}",
                           "X-Amz-Date": stamp, "X-Amz-Expires": str(expires), "X-Amz-SignedHeaders": "host"})
            if self._token:
                params["X-Amz-Security-Token"] = self._token
        canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(params.items()))
        if self._key is not None:
            request = "\n".join(["GET", canonical_uri, canonical_query, f"host:{self.host}\n", "host",
                                 _UNSIGNED])
            to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                                 hashlib.sha256(request.encode()).hexdigest()])
            signing_key = _hmac(_hmac(_hmac(_hmac(f"AWS4{self._secret}".encode(), day), self.region),
                                      "s3"), "aws4_request")
            signature = hmac.new(signing_key, to_sign.encode(), hashlib.sha256).hexdigest()
            canonical_query += f"&X-Amz-Signature={signature}"
        query_part = f"?{canonical_query}" if canonical_query else ""
        return f"{self.scheme}://{self.host}{canonical_uri}{query_part}"

    async def generate_presigned_url(self, operation: str, Params: Mapping[str, str],  # noqa: N803
                                     ExpiresIn: int = 3600) -> str:  # noqa: N803
        """botocore's presigner's interface, for ``get_object`` (client.py's ``_PresignedS3``)."""
        if operation != "get_object":
            raise LiteUnsupported(operation)
        return self.url(Params["Bucket"], Params["Key"], expires=ExpiresIn)

    # ---- listing ----------------------------------------------------------------------------

    def list(self, bucket: str, prefix: str, *, timeout: float, delimiter: str | None = None,
             while_waiting: Callable[[], None] | None = None,
             page_size: int | None = None) -> list[tuple[str, int, str | None]]:
        """``(key, size, etag)`` of every object under ``prefix`` (all pages: ListObjectsV2), over
        one connection (``page_size``: keys per page, the server's default 1,000 when ``None``).
        ``while_waiting`` runs once, after the first request is sent, before its answer is read
        (work that overlaps the round trip). Raises
        ``FileNotFoundError`` (404: no such bucket), ``LiteUnsupported`` (another 4xx),
        ``OSError`` (the rest)."""
        conn = self._connection(timeout)
        out: list[tuple[str, int, str | None]] = []
        token: str | None = None
        try:
            while True:
                query = {"list-type": "2", "prefix": prefix, "encoding-type": "url"}
                if delimiter:
                    query["delimiter"] = delimiter
                if page_size:
                    query["max-keys"] = str(page_size)
                if token:
                    query["continuation-token"] = token
                self._send(conn, self._target(bucket, "", query))
                if while_waiting is not None:
                    hook, while_waiting = while_waiting, None  # once: the first page's wait
                    hook()
                resp = conn.getresponse()
                body = resp.read()
                self._proxy_answer(resp.status, f"s3://{bucket}/{prefix}")
                if resp.status == 404:
                    raise FileNotFoundError(f"NoSuchBucket: {bucket}: {body[:200]!r}")
                if 400 <= resp.status < 500 and resp.status not in (408, 429):
                    raise LiteUnsupported(f"HTTP {resp.status}")
                if resp.status != 200:
                    raise OSError(f"listing s3://{bucket}/{prefix}: HTTP {resp.status} {body[:200]!r}")
                root = ET.fromstring(body)
                for item in root.iter():
                    if _local(item.tag) == "Contents":
                        field = {_local(child.tag): child.text or "" for child in item}
                        etag = field.get("ETag", "").strip('"') or None
                        key = urllib.parse.unquote_plus(field.get("Key", ""))  # encoding-type=url
                        out.append((key, int(field.get("Size") or 0), etag))
                top = {_local(child.tag): child.text or "" for child in root}
                token = top.get("NextContinuationToken")
                if top.get("IsTruncated") != "true" or not token:
                    return out
        except ET.ParseError as exc:
            raise OSError(f"listing s3://{bucket}/{prefix}: unreadable answer ({exc})") from exc
        finally:
            conn.close()

    def get(self, bucket: str, key: str, *, timeout: float,
            while_waiting: Callable[[], None] | None = None) -> tuple[int, bytes]:
        """One presigned GET of ``bucket/key``: ``(status, body)`` of a 2xx answer. ``while_waiting``
        as in :meth:`list`. Raises as :meth:`list` does: ``FileNotFoundError`` (404),
        ``LiteUnsupported`` (another 4xx but 408 and 429), ``OSError`` (the rest)."""
        conn = self._connection(timeout)
        try:
            self._send(conn, self._target(bucket, key))
            if while_waiting is not None:
                while_waiting()
            resp = conn.getresponse()
            body = resp.read()
            what = f"s3://{bucket}/{key}"
            self._proxy_answer(resp.status, what)
            if resp.status == 404:
                raise FileNotFoundError(f"{what}: HTTP 404 {body[:200]!r}")
            if 400 <= resp.status < 500 and resp.status not in (408, 429):
                raise LiteUnsupported(f"HTTP {resp.status}")
            if not 200 <= resp.status < 300:
                raise OSError(f"GET {what}: HTTP {resp.status} {body[:200]!r}")
            return resp.status, body
        finally:
            conn.close()

    # ---- connections -----------------------------------------------------------------------

    def _target(self, bucket: str, key: str = "", query: Mapping[str, str] | None = None) -> str:
        signed = self.url(bucket, key, query)
        if self.proxy is not None and self.scheme == "http":
            return signed  # absolute-form, for the proxy
        url = urllib.parse.urlsplit(signed)
        return f"{url.path}?{url.query}" if url.query else url.path

    def _headers(self) -> dict[str, str]:
        if self.proxy is not None and self.scheme == "http" and self.proxy.authorization:
            return {"Proxy-Authorization": self.proxy.authorization}
        return {}

    def _send(self, conn: http.client.HTTPConnection, target: str) -> None:
        """Send the GET; a failure to connect is raised typed, with what to do about it."""
        origin = f"{self.scheme}://{self.host}"
        try:
            conn.request("GET", target, headers=self._headers())
        except OSError as exc:
            via = f" through proxy {self.proxy.shown} ({self.proxy.source})" if self.proxy else ""
            if self.proxy is not None and str(exc).startswith("Tunnel connection failed"):
                raise _proxy_refused(self.proxy.shown, self.proxy.source, str(exc), origin) from exc
            raise connect_error(exc, origin, self.network, via) from exc

    def _proxy_answer(self, status: int, origin: str) -> None:
        """A proxy's 407 to an absolute-form request: permanent, with what to do."""
        if status == 407 and self.proxy is not None:
            raise _proxy_refused(self.proxy.shown, self.proxy.source, "407 Proxy Authentication Required",
                                 origin)

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        """A connection to the endpoint (through the proxy where one routes it)."""
        proxy = self.proxy
        if self.scheme == "https":
            context = self.ssl_context or self.network.ssl_context(f"https://{self.host}")
            if proxy is None:
                return http.client.HTTPSConnection(self.host, timeout=timeout, context=context)
            tunnel = http.client.HTTPSConnection(proxy.host, proxy.port, timeout=timeout, context=context)
            host, port = self.conn_key[1], self.conn_key[2]
            tunnel.set_tunnel(host, port, headers={"Proxy-Authorization": proxy.authorization}
                              if proxy.authorization else None)
            return tunnel
        if proxy is not None:
            return http.client.HTTPConnection(proxy.host, proxy.port, timeout=timeout)
        return http.client.HTTPConnection(self.host, timeout=timeout)


def _proxy_refused(shown: str, source: str, answer: str, url: str) -> ProxyError:
    if "407" in answer:
        return ProxyAuthError(f"the proxy {shown} ({source}) refused {url}: {answer}; give the proxy's "
                              "user and password in its URL (http://user:password@host:port)", url=url)
    return ProxyError(f"the proxy {shown} ({source}) could not open the way to {url}: {answer}", url=url)
