"""How a request reaches its host: the forward proxy it goes through and the certificates it trusts.

One place decides both, for every path that opens its own connections (our HTTP/1.1 pool,
``http1``; LITE-S3's listing and GETs, ``s3lite``; the aiohttp session of presigned GETs,
``session``). Paths that run a third-party client (s3fs/botocore, gcsfs, fsspec's HTTP) are
given the same answers through their own options by ``backends``.

Proxies, read the way requests and botocore read it:

- the storage options first: ``config_kwargs={"proxies": {"http": URL, "https": URL}}``
  (botocore's ``Config(proxies=...)``, what s3fs users write) or ``proxies={...}`` at the top;
  a key may also be ``"http://host"`` / ``"https://host"`` (one host's proxy) or ``"all"``;
- else the environment: ``https_proxy``/``HTTPS_PROXY`` for ``https://`` URLs,
  ``http_proxy``/``HTTP_PROXY`` for ``http://`` ones, ``all_proxy``/``ALL_PROXY`` for either
  (lower case first, as curl and requests do);
- ``no_proxy``/``NO_PROXY`` (from the environment, or ``"no_proxy"`` in the options' proxies)
  sends a host direct: ``*``; a host name (``bucket.corp``, also matching its sub-domains);
  a domain with a leading dot (``.corp``); ``host:port`` (that port only); an IP address or
  network (``10.0.0.0/8``);
- a proxy URL is ``http://[user:password@]host[:port]`` (port 80 by default; ``https://``
  proxies and SOCKS are refused with a :class:`SpecError` that says so). ``http://`` URLs go
  through it as absolute-form requests, ``https://`` ones through a ``CONNECT`` tunnel; the
  user and password become a ``Proxy-Authorization: Basic`` header. They are secrets: a
  :class:`Proxy`'s repr and every message built here show the proxy as ``user:***@host``.

Certificates, per request URL:

- ``verify`` in the storage options (top level, or ``client_kwargs={"verify": ...}`` as s3fs
  takes it): ``False`` skips verification (warned once per process, :class:`InsecureTLSWarning`),
  a path is the CA bundle (a file, or a directory of hashed certificates);
- else, for S3 URLs, ``AWS_CA_BUNDLE`` (botocore's variable); else ``REQUESTS_CA_BUNDLE``;
  else ``SSL_CERT_FILE``/``SSL_CERT_DIR`` (what OpenSSL's default paths read, loaded
  explicitly); else the system's trust store;
- a bundle is loaded once per process (loading costs ~0.1 s), contexts are shared.

A TLS failure to verify is permanent (``errors.CertificateError``, never retried); its
message names the host and :func:`certificate_hint` the ways to trust it. A host that does
not resolve says whether a proxy was configured (:func:`resolution_hint`).
"""

from __future__ import annotations

import base64
import ipaddress
import os
import ssl
import threading
import urllib.parse
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from streamdata.config import env_snapshot, env_str
from streamdata.errors import SpecError

__all__ = ["InsecureTLSWarning", "Network", "Proxy", "bypassed", "certificate_hint", "network_for",
           "resolution_hint"]

_SCHEMES = ("http", "https")


class InsecureTLSWarning(UserWarning):
    """TLS certificates are not verified (``verify=False`` in the storage options)."""


@dataclass(frozen=True)
class Proxy:
    """A forward proxy: where to connect, and the ``Proxy-Authorization`` header, if any."""

    host: str
    port: int
    authorization: str | None = field(default=None, repr=False)
    user: str | None = field(default=None, repr=False)
    source: str = ""  # where it was configured: "HTTPS_PROXY", "storage_options proxies", ...
    url: str = field(default="", repr=False)  # as configured, credentials included: a secret

    def basic_credentials(self) -> str:
        """``user:password`` (for a client that takes them apart); "" without credentials."""
        if not self.authorization:
            return ""
        return base64.b64decode(self.authorization.split(" ", 1)[1]).decode()

    @property
    def shown(self) -> str:
        """The proxy as messages show it: ``http://user:***@host:port`` (never the password)."""
        who = f"{urllib.parse.quote(self.user, safe='')}:***@" if self.user is not None else ""
        return f"http://{who}{self.host}:{self.port}"

    def __repr__(self) -> str:
        return f"Proxy({self.shown}, from {self.source or '?'})"

    @classmethod
    def parse(cls, url: str, source: str) -> Proxy:
        """``http://[user:password@]host[:port]``; a bare ``host:port`` is read as http."""
        text = url.strip()
        if "://" not in text:
            text = "http://" + text
        parts = urllib.parse.urlsplit(text)
        if parts.scheme.lower() != "http":
            raise SpecError(f"proxy {_shown_url(text)} (from {source}): only http:// proxies are "
                            f"supported (a CONNECT tunnel carries https through one); not {parts.scheme}://")
        try:
            port = parts.port or 80
        except ValueError as err:
            raise SpecError(f"proxy {_shown_url(text)} (from {source}): {err}") from None
        if not parts.hostname:
            raise SpecError(f"proxy {_shown_url(text)} (from {source}) names no host")
        auth = user = None
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        return cls(parts.hostname, port, auth, user, source, text)


def _shown_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


# ---- NO_PROXY -------------------------------------------------------------------------------------


def bypassed(host: str, port: int | None, no_proxy: str | None) -> bool:
    """Whether ``no_proxy`` (a comma-separated list) sends ``host:port`` direct."""
    if not no_proxy:
        return False
    host = host.strip("[]").lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in (e.strip().lower() for e in no_proxy.replace(" ", ",").split(",")):
        if not entry:
            continue
        if entry == "*":
            return True
        name, want_port = entry, None
        if entry.startswith("["):  # [::1]:8080
            name, _, rest = entry[1:].partition("]")
            want_port = rest[1:] if rest.startswith(":") else None
        elif entry.count(":") == 1:
            name, _, want_port = entry.partition(":")
        if want_port is not None and (not want_port.isdigit() or int(want_port) != port):
            continue
        if address is not None:
            try:
                if address in ipaddress.ip_network(name, strict=False):
                    return True
            except ValueError:
                pass
            continue
        name = name.lstrip("*").lstrip(".").rstrip(".")
        if name and (host == name or host.endswith("." + name)):
            return True
    return False


# ---- the route and the trust of one set of storage options ---------------------------------------


def _env(name: str) -> tuple[str, str] | None:
    """``(value, variable)`` of the lower-case variable, else the upper-case one (non-empty)."""
    for variable in (name.lower(), name.upper()):
        value = env_str(variable)
        if value:
            return value, variable
    return None


def _option_proxies(options: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for holder in (options, options.get("config_kwargs") or {}, options.get("client_kwargs") or {}):
        if isinstance(holder, Mapping) and isinstance(holder.get("proxies"), Mapping):
            return holder["proxies"]
    return None


def _verify_option(options: Mapping[str, Any]) -> Any:
    if "verify" in options:
        return options["verify"]
    client = options.get("client_kwargs")
    if isinstance(client, Mapping) and "verify" in client:
        return client["verify"]
    return None


_contexts: dict[tuple[str | None, bool], ssl.SSLContext] = {}
_contexts_lock = threading.Lock()
_warned: set[str] = set()


def _context(bundle: str | None, verify: bool) -> ssl.SSLContext:
    """One shared client context per CA bundle (``None``: the system's), or unverified."""
    key = (bundle, verify)
    with _contexts_lock:
        ctx = _contexts.get(key)
        if ctx is None:
            if not verify:
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            elif bundle is None:
                ctx = ssl.create_default_context()  # SSL_CERT_FILE / SSL_CERT_DIR, else the system's
            elif os.path.isdir(bundle):
                ctx = ssl.create_default_context(capath=bundle)
            else:
                try:
                    ctx = ssl.create_default_context(cafile=bundle)
                except (OSError, ssl.SSLError) as err:
                    raise SpecError(f"the CA bundle {bundle!r} cannot be read: {err}; give a PEM file "
                                    "of the certificates to trust") from None
            _contexts[key] = ctx
        return ctx


class Network:
    """The proxies and the trust of one set of storage options (read once, when made).

    ``proxy(url)``: the :class:`Proxy` a request to ``url`` goes through, or ``None`` (direct).
    ``ssl_context(url)``: the context a TLS connection to ``url`` verifies with.
    """

    def __init__(self, options: Mapping[str, Any] | None = None, *, protocol: str | None = None) -> None:
        options = dict(options or {})
        self.protocol = protocol
        given = _option_proxies(options)
        self._by_scheme: dict[str, Proxy | None] = {}
        self._by_host: dict[str, Proxy] = {}
        self._no_proxy: str | None = None
        self._no_proxy_source = ""
        if given is not None:
            for key, value in given.items():
                if str(key).lower() == "no_proxy":
                    self._no_proxy, self._no_proxy_source = value, "storage_options proxies"
                elif value:
                    proxy = Proxy.parse(str(value), f"storage_options proxies[{key!r}]")
                    name = str(key).lower()
                    if "://" in name:
                        self._by_host[name.rstrip("/")] = proxy
                    elif name in (*_SCHEMES, "all"):
                        self._by_scheme[name] = proxy
            self._by_scheme.setdefault("http", self._by_scheme.get("all"))
            self._by_scheme.setdefault("https", self._by_scheme.get("all"))
        else:
            every = _env("all_proxy")
            for scheme in _SCHEMES:
                found = _env(f"{scheme}_proxy") or every
                self._by_scheme[scheme] = Proxy.parse(found[0], found[1]) if found else None
        if self._no_proxy is None:
            found = _env("no_proxy")
            if found:
                self._no_proxy, self._no_proxy_source = found
        verify = _verify_option(options)
        self.verify = verify is not False
        self.bundle: str | None = None
        self.bundle_source = "the system's trust store"
        if isinstance(verify, (str, os.PathLike)):
            self.bundle, self.bundle_source = os.fspath(verify), "storage_options verify"
        elif self.verify:
            names = (("AWS_CA_BUNDLE",) if protocol in ("s3", "s3a") else ()) + ("REQUESTS_CA_BUNDLE",)
            for name in names:
                if env_str(name):
                    self.bundle, self.bundle_source = env_str(name), name
                    break
            else:
                # what OpenSSL's default paths would read, loaded explicitly: a client (aiohttp)
                # may have made its default context before the variable was set
                for name in ("SSL_CERT_FILE", "SSL_CERT_DIR"):
                    if env_str(name):
                        self.bundle, self.bundle_source = env_str(name), name
                        break

    @property
    def proxied(self) -> bool:
        """Whether any proxy is configured (some URLs may still bypass it)."""
        return any(self._by_scheme.values()) or bool(self._by_host)

    def proxy_url(self, scheme: str) -> str | None:
        """The URL (credentials included) of the proxy for every ``scheme`` URL not bypassed."""
        proxy = self._by_scheme.get(scheme)
        return proxy.url if proxy is not None else None

    def proxy(self, url: str) -> Proxy | None:
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        host = parts.hostname or ""
        port = parts.port or (443 if scheme == "https" else 80)
        proxy = self._by_host.get(f"{scheme}://{host}") or self._by_scheme.get(scheme)
        if proxy is None or bypassed(host, port, self._no_proxy):
            return None
        return proxy

    def ssl_context(self, url: str | None = None) -> ssl.SSLContext:
        if not self.verify:
            host = urllib.parse.urlsplit(url).hostname if url else None
            if "*" not in _warned:
                _warned.add("*")
                warnings.warn(f"TLS certificates are not verified (verify=False in the storage options; "
                              f"first host: {host or '?'}): anyone on the path can read and change "
                              "the data", InsecureTLSWarning, stacklevel=3)
        return _context(self.bundle, self.verify)

    def __repr__(self) -> str:
        routes = ", ".join(f"{k}={v.shown if v else 'direct'}" for k, v in self._by_scheme.items())
        trust = self.bundle or self.bundle_source
        return f"Network({routes or 'direct'}, trust={trust}, verify={self.verify})"


_ENVIRONMENT = tuple(name for base in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
                     for name in (base, base.upper())) + (
    "AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR")
_networks: dict[tuple[Any, ...], Network] = {}
_MAX_NETWORKS = 64  # distinct option sets and environments kept (a process has a handful)


def network_for(options: Mapping[str, Any] | None, protocol: str | None = None) -> Network:
    """The :class:`Network` of these options and the environment's variables as they are now
    (one per distinct set: each request asks, and a changed variable takes effect)."""
    key = (protocol, repr(sorted((k, repr(v)) for k, v in (options or {}).items())),
           tuple(env_snapshot(_ENVIRONMENT).values()))
    net = _networks.get(key)
    if net is None:
        if len(_networks) >= _MAX_NETWORKS:
            _networks.clear()
        net = _networks[key] = Network(options, protocol=protocol)
    return net


# ---- hints for errors -------------------------------------------------------------------------------


def certificate_hint(host: str, net: Network | None = None) -> str:
    """What to do about a certificate that did not verify for ``host``."""
    using = f" (verified against {net.bundle or net.bundle_source})" if net is not None else ""
    return (f"the TLS certificate of {host} is not trusted{using}: a retry cannot fix this. Trust "
            "the certificate authority that signed it: set AWS_CA_BUNDLE (S3), REQUESTS_CA_BUNDLE or "
            "SSL_CERT_FILE to a PEM file of it, or pass storage_options={'client_kwargs': {'verify': "
            "'/path/to/ca.pem'}}; verify=False turns checking off (not recommended)")


def resolution_hint(host: str, url: str, net: Network | None = None) -> str:
    """What a name that does not resolve may mean, given the proxies configured."""
    scheme = urllib.parse.urlsplit(url).scheme.lower() or "https"
    proxy = net.proxy(url) if net is not None else None
    if proxy is not None:
        return (f"the proxy {proxy.shown} ({proxy.source}) could not resolve {host}: check the name, "
                "or whether that proxy can reach it")
    if net is not None and net.proxied:
        return (f"{host} was resolved here, not by the configured proxy: "
                f"{net._no_proxy_source or 'NO_PROXY'} sends it direct; remove it from there if only "
                "the proxy can reach it")
    return (f"{host} could not be resolved and no proxy is configured: if this network reaches "
            f"it through a forward proxy, set {scheme.upper()}_PROXY (or ALL_PROXY) to its URL")
