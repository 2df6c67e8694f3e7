"""Backend plumbing: fsspec filesystems per protocol, S3 sessions and signers, error translation.

What a URL means is ``urls``' business; this module turns a protocol and storage options
into a working filesystem, closes it cleanly, and maps backend exceptions to ours.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
import time
import types
import urllib.parse
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from streamdata.config import env_snapshot, env_str
from streamdata.errors import (
    AccessDeniedError,
    BackendMissingError,
    CertificateError,
    FetchTimeoutError,
    ProxyAuthError,
    ShardFetchError,
    ShardNotFoundError,
    SpecError,
    StreamDataError,
    TransportError,
)
from streamdata.store.network import certificate_hint, network_for
from streamdata.store.session import transport_error

__all__ = ["call_with_deadline", "close_filesystem", "close_sessions", "filesystem", "inherited_signer",
           "lite_path", "lite_s3", "signer_key", "translate_error", "warm_imports"]

T = TypeVar("T")

# protocol -> the pip extra / package that provides it, for BackendMissingError
_BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp",
             "https": "aiohttp", "hdfs": "pyarrow (and a Hadoop client: JAVA_HOME, HADOOP_HOME, CLASSPATH)",
             "hf": "huggingface_hub (pip install 'streamdata[hub]')"}


def filesystem(protocol: str, storage_options: Mapping[str, Any] | None = None, *,
               url: str | None = None, timeout: float | None = None, **extra: Any):
    """A fresh fsspec filesystem for ``protocol``, never the instance cache (LOOP-AFTER-FORK, ``store.loop``).

    ``url`` contributes what the URL itself carries (an HDFS name node's host and port).
    ``timeout`` (seconds per request) bounds the backend's own requests and turns its own
    retries off, where ``storage_options`` do not say otherwise (:func:`_bounded`).
    """
    import fsspec

    try:
        if protocol == "hf":  # huggingface_hub's, reading @~parquet (``hub``)
            from streamdata.store.hub import hub_filesystem_class

            cls = hub_filesystem_class()
        else:
            cls = fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        need = _BACKENDS.get(protocol, "the fsspec backend for it")
        raise BackendMissingError(
            f"reading {protocol}:// URLs needs {need}: pip install 'streamdata' brings it, "
            f"or install it directly ({exc})") from exc
    except ValueError as exc:
        raise SpecError(f"unknown protocol {protocol!r}: use s3://, gs://, hdfs://, http(s)://, hf://, "
                        "file:// or a local path") from exc
    options = dict(cls._get_kwargs_from_urls(url)) if url else {}
    options.update(storage_options or {})
    options.update(extra)
    options = _networked(protocol, options, url)
    if timeout is not None:
        options = _bounded(protocol, options, timeout)
    if protocol in ("s3", "s3a") and not {"session", "profile"} & set(options):
        options["session"] = _s3_session()
    try:
        fs = cls(skip_instance_cache=True, **options)
    except TypeError as exc:
        raise SpecError(f"storage_options not accepted by {cls.__name__}: {exc}") from exc
    except (ImportError, OSError) as exc:
        need = _BACKENDS.get(protocol, "its client libraries")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BackendMissingError(f"the {protocol}:// backend could not start ({first}); it needs "
                                  f"{need}", url=url) from exc
    fs._streamdata_signer_key = signer_key(protocol, storage_options)
    if timeout is not None and protocol in ("s3", "s3a"):
        fs.retries = 1  # s3fs's own retry loop (_error_wrapper, 5 tries): one try; ours retry
    if timeout is not None and protocol in ("gs", "gcs"):
        _one_try_per_gcs_request(fs)
    if protocol in ("gs", "gcs"):
        _require_gcs_credentials(fs, options, url)
    return fs


def _one_try_per_gcs_request(fs: Any) -> None:
    """gcsfs tries every request up to 6 times, sleeping up to 32 s between tries, inside its
    ``_request`` (a decorator bound when the class is made: no option changes it). On this
    instance, call the undecorated method, so that ours are the only retries: bounded by our
    deadline and counted per reason, like S3's."""
    raw = getattr(type(fs)._request, "__wrapped__", None)
    if raw is not None:
        fs._request = types.MethodType(raw, fs)


def _networked(protocol: str, options: dict[str, Any], url: str | None) -> dict[str, Any]:
    """``options`` saying to the backend's own client what ``network`` decides for ours
    (proxies, certificates), in the words that client takes; what the user set is kept.

    - s3 (botocore): ``proxies``/``verify`` given at the top go where s3fs passes them on
      (``config_kwargs["proxies"]``, ``client_kwargs["verify"]``); botocore reads
      ``HTTP(S)_PROXY``/``NO_PROXY`` and ``AWS_CA_BUNDLE`` itself; ``ALL_PROXY`` and
      ``REQUESTS_CA_BUNDLE``, which it does not read, are given to it explicitly;
    - gs (gcsfs) and http(s) (fsspec's HTTP), both aiohttp: the environment's proxies through
      ``trust_env`` (aiohttp reads ``HTTP(S)_PROXY`` and ``NO_PROXY``), those of the options
      as the session's or the requests' ``proxy``; a CA bundle or ``verify=False`` as the
      requests' ``ssl`` (fsspec's HTTP; gcsfs takes no per-request options: there the system's
      store, ``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` apply).
    """
    if protocol not in ("s3", "s3a", "gs", "gcs", "http", "https"):
        return options
    net = network_for(options, protocol)
    options = dict(options)
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        client = dict(options.get("client_kwargs") or {})
        top = options.pop("proxies", None)
        if top is not None:
            config.setdefault("proxies", top)
        elif "proxies" not in config and net.proxied and not any(
                env_str(name) for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY")):
            config["proxies"] = {scheme: route for scheme in ("http", "https")
                                 if (route := net.proxy_url(scheme)) is not None}  # ALL_PROXY
        if "verify" in options:
            client.setdefault("verify", options.pop("verify"))
        elif "verify" not in client and net.bundle_source == "REQUESTS_CA_BUNDLE":
            client["verify"] = net.bundle
        if config:
            options["config_kwargs"] = config
        if client:
            options["client_kwargs"] = client
        return options
    given = any("proxies" in holder for holder in (options, options.get("config_kwargs") or {},
                                                   options.get("client_kwargs") or {}))
    options.pop("proxies", None)
    if protocol in ("gs", "gcs"):
        where = str(options.get("endpoint_url") or "https://storage.googleapis.com")
    else:
        where = url if url and "://" in url else f"{protocol}://localhost"
    proxy = net.proxy(where) if given else None
    verify = options.pop("verify", None)
    if protocol in ("gs", "gcs"):
        session = dict(options.get("session_kwargs") or {})
        if proxy is not None:
            session.setdefault("proxy", f"http://{proxy.host}:{proxy.port}")
            if proxy.user is not None:
                import aiohttp

                user, _, password = proxy.basic_credentials().partition(":")
                session.setdefault("proxy_auth", aiohttp.BasicAuth(user, password))
        elif not given:
            session.setdefault("trust_env", True)
        options["session_kwargs"] = session
        return options
    client = dict(options.get("client_kwargs") or {})
    client.pop("proxies", None)
    if proxy is not None:
        options.setdefault("proxy", f"http://{proxy.host}:{proxy.port}")
        if proxy.authorization:
            headers = dict(options.get("proxy_headers") or {})
            headers.setdefault("Proxy-Authorization", proxy.authorization)
            options["proxy_headers"] = headers
    elif not given:
        client.setdefault("trust_env", True)
    if verify is False or net.bundle is not None:
        options.setdefault("ssl", net.ssl_context(where))
    options["client_kwargs"] = client
    return options


def _bounded(protocol: str, options: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``options`` with the backend's request timeouts set to ``timeout`` and its own retries
    off, so they neither outlast nor multiply ours; what the user set is kept."""
    options = dict(options)
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout)
        config.setdefault("read_timeout", timeout)
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})  # no retry
        options["config_kwargs"] = config
    elif protocol in ("gs", "gcs"):
        options.setdefault("requests_timeout", timeout)
        options.setdefault("timeout", timeout)
        _quiet("gcsfs")
    elif protocol in ("http", "https"):
        import aiohttp

        client = dict(options.get("client_kwargs") or {})
        client.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=timeout,
                                                           sock_read=timeout))
        options["client_kwargs"] = client
    return options


def _quiet(name: str) -> None:
    """Keep a library's log records off stderr when the application configured no logging
    (Python's last-resort handler would print them: gcsfs logs a traceback per failed
    request); an application's own handlers still receive them."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())


_GCS_HINT = ("no Google Cloud credentials were found. Tried: token= in storage_options, "
             "GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-default credentials "
             "(gcloud auth application-default login) and the GCE metadata server. For a public "
             "bucket pass storage_options={'token': 'anon'}")


def _require_gcs_credentials(fs: Any, options: Mapping[str, Any], url: str | None) -> None:
    """gcsfs falls back to anonymous access when it finds no credentials; against Google's
    own endpoint that only fails later, slowly (retries of 401s). Fail now, saying what was
    tried. An emulator's endpoint, or ``token="anon"``, is anonymous on purpose."""
    creds = getattr(fs, "credentials", None)
    if options.get("token") is not None or getattr(creds, "method", None) != "anon":
        return
    if "googleapis.com" not in str(getattr(fs, "_location", "googleapis.com")):
        return
    raise AccessDeniedError(f"cannot access {url or 'gs://'}: {_GCS_HINT}", url=url)


async def close_sessions(fs: Any) -> None:
    """Close an fsspec async backend's connections: s3fs's botocore client, or the aiohttp
    session of gcsfs and HTTP. Run on the filesystem's own loop."""
    creator = getattr(fs, "_s3creator", None)
    if creator is not None and hasattr(creator, "__aexit__"):
        key = getattr(fs, "_streamdata_signer_key", None)
        if key is not None and getattr(fs, "_s3", None) is not None:
            _SIGNERS.setdefault(key, fs._s3)  # still signs once closed: see inherited_signer
        await creator.__aexit__(None, None, None)
        fs._s3creator = fs._s3 = None
        _detach_finalizers(fs)
    session = getattr(fs, "_session", None)
    if session is not None and not session.closed:
        await session.close()


# SIGNER-REUSE: the botocore S3 client of a closed listing filesystem, kept by the storage
# options it was made with. Presigning a URL is CPU work only (no connection, no loop of its
# own), so the process that listed, and every DataLoader worker forked from it, signs with
# this client instead of building one: building it cost each worker 0.1-0.2 s of CPU per
# pass (botocore parses S3's endpoint rules anew for every client), all of it before the
# first request. Spawned workers start without it and build their own, as before.
_SIGNERS: dict[str, Any] = {}


# environment variables botocore reads when it builds a client: part of a signer's identity
_SIGNER_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
               "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_S3_ADDRESSING_STYLE")


def signer_key(protocol: str, storage_options: Mapping[str, Any] | None) -> str | None:
    """The key of :data:`_SIGNERS` for these options (and the AWS environment);
    ``None`` where a signer is not shared."""
    options = dict(storage_options or {})
    if protocol not in ("s3", "s3a") or {"session", "cache_regions"} & set(options):
        return None
    env = env_snapshot(_SIGNER_ENV)
    try:
        return json.dumps([options, env], sort_keys=True)
    except (TypeError, ValueError):  # options that are not plain data (a credentials object...)
        return None


def inherited_signer(protocol: str, storage_options: Mapping[str, Any] | None) -> Any:
    """A closed S3 client that can presign URLs for these options, if this process has one."""
    key = signer_key(protocol, storage_options)
    return _SIGNERS.get(key) if key is not None else None


def lite_s3(protocol: str, storage_options: Mapping[str, Any] | None) -> Any:
    """A botocore-free S3 signer for these options (LITE-S3, ``s3lite``), or ``None``."""
    if protocol not in ("s3", "s3a"):
        return None
    from streamdata.store.s3lite import ENV_NAMES, LiteS3

    return LiteS3.from_options(storage_options, env_snapshot(ENV_NAMES))


_WARM = {"s3": ("aiohttp",), "s3a": ("aiohttp",), "http": ("aiohttp",), "https": ("aiohttp",),
         "hf": ("huggingface_hub.utils",)}


def lite_path(url: str) -> str:
    """``bucket/key`` of an S3 URL under LITE-S3, as s3fs's ``_strip_protocol`` gives it."""
    return url.split("://", 1)[-1].rstrip("/")


def warm_imports(protocol: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Import what this protocol's readers will need (aiohttp for S3's presigned GETs and
    HTTP) now, in the process that builds the dataset: forked DataLoader workers inherit the
    modules instead of each importing them before its first request (0.3 s of CPU each on
    a 2-core machine). Called while the listing's request is in flight, it costs nothing.
    Under LITE-S3 with LITE-HTTP (``store.http1``) S3's readers need no aiohttp: only an ``https``
    endpoint's SSL context is made (its CA bundle loaded once, inherited by workers)."""
    import importlib

    from streamdata.config import lite_http

    lite = lite_s3(protocol, storage_options) if lite_http() else None
    if lite is not None:
        if lite.scheme == "https":
            from streamdata.store.http1 import default_ssl_context

            default_ssl_context()
        return
    for name in _WARM.get(protocol, ()):
        try:
            importlib.import_module(name)
        except ImportError:  # the reader reports the missing backend where it needs it
            pass


def _detach_finalizers(fs: Any) -> None:
    """Drop the ``weakref.finalize`` hooks s3fs registered to close ``fs``'s client: it is
    closed already. Left in place, the hook runs when ``fs`` is collected, and in a forked
    DataLoader worker it waits on the parent's loop, which looks running there but is not: a
    worker would stall up to a second per such filesystem before its first request."""
    for hook in list(getattr(weakref.finalize, "_registry", {})):
        info = hook.peek()
        if info is not None and info[0] is fs:
            hook.detach()


def close_filesystem(fs: Any) -> None:
    """Close a sync fsspec filesystem's connections now, on its own loop.

    Left to the garbage collector, s3fs closes them from whatever thread collects, which
    may be another reader's loop thread ("attached to a different loop").
    """
    loop = getattr(fs, "loop", None)
    if getattr(fs, "asynchronous", True) or loop is None or not loop.is_running():
        return
    from fsspec.asyn import sync

    try:
        sync(loop, close_sessions, fs, timeout=5)
    except Exception:  # best effort: the listing already succeeded
        pass


# What botocore reads when a session resolves its credentials: a session resolves them once
# and keeps them, so each set of these values has a session of its own.
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                   "AWS_DEFAULT_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
                   "AWS_EC2_METADATA_DISABLED", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                   "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN")
_S3_SESSIONS: dict[str, Any] = {}


def _s3_session() -> Any:
    """One aiobotocore session per process and credential environment, shared by its S3
    filesystems.

    A session holds parsed botocore models but no connection and no loop (clients do). Made
    in the main process by the listing, it is inherited by forked DataLoader workers, which
    then skip re-parsing botocore's JSON, all of which would come before a worker's first
    request. A session keeps the credentials it
    resolved first, so it is kept by the environment they came from (hashed: no secret is
    held in the key): a process whose credential variables change gets a new session.
    """
    identity = hashlib.sha256(json.dumps(env_snapshot(_CREDENTIAL_ENV), sort_keys=True).encode()).hexdigest()
    session = _S3_SESSIONS.get(identity)
    if session is None:
        from aiobotocore.session import AioSession

        session = _S3_SESSIONS[identity] = AioSession()
    return session


def translate_error(exc: BaseException, url: str, action: str = "read") -> StreamDataError:
    """Map a backend exception to ours, naming the URL and what to check. A transport failure
    (``TransportError``, raised against a presigned or redirected URL) becomes the error of
    ``url``: ``FetchTimeoutError`` for a timeout, else ``ShardFetchError``, caused by it."""
    if isinstance(exc, StreamDataError) and not isinstance(exc, TransportError):
        return exc
    exc = transport_error(exc, url)  # a socket's or aiohttp's failure, typed (TYPED-TRANSPORT-ERRORS)
    name = type(exc).__name__
    text = str(exc)
    status = getattr(exc, "code", None) or getattr(exc, "status", None) \
        or getattr(getattr(exc, "response", None), "status_code", None)  # gcsfs, aiohttp; huggingface_hub
    if isinstance(exc, (CertificateError, ProxyAuthError)):  # permanent; the text says what to do
        if isinstance(exc, CertificateError) and "a retry cannot fix this" not in text:
            host = urllib.parse.urlsplit(exc.url or url).hostname or url
            text += "; " + certificate_hint(host)
        err: StreamDataError = ShardFetchError(f"cannot {action} {url}: {text}", url=url)
        err.__cause__ = exc
        err.refused_by = type(exc).__name__  # type: ignore[attr-defined]  # kept across processes
        return err
    if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in text or "NoSuchKey" in text \
            or status == 404:
        err = ShardNotFoundError(
            f"cannot {action} {url}: no such bucket or object. Check the bucket name, the key, "
            f"and the endpoint in storage_options ({name}: {text})", url=url)
    elif isinstance(exc, PermissionError) or "Credentials" in name or "AccessDenied" in text \
            or status in (401, 403) \
            or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        err = AccessDeniedError(
            f"cannot {action} {url}: access denied. Check credentials (storage_options key/secret "
            f"or token, AWS_PROFILE / AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS) and the "
            f"bucket policy ({name}: {text})", url=url)
    elif isinstance(exc, TimeoutError) or any("Timeout" in c.__name__ for c in type(exc).__mro__):
        err = FetchTimeoutError(f"cannot {action} {url}: no answer within the timeout ({name}"
                                f"{': ' + text if text else ''}); check the endpoint and the network",
                                url=url)
    else:
        err = ShardFetchError(f"cannot {action} {url}: {name}: {text}", url=url)
    err.__cause__ = exc
    return err


def _transient(err: StreamDataError) -> bool:
    """Worth another try: a timeout or a failed request, not a missing object, refused access
    or an untrusted certificate."""
    if isinstance(err.__cause__, (CertificateError, ProxyAuthError)):
        return False
    return isinstance(err, FetchTimeoutError) or (
        isinstance(err, ShardFetchError) and not isinstance(err, (ShardNotFoundError, AccessDeniedError)))


def call_with_deadline(fn: Callable[[float], T], *, timeout: float | None, deadline: float, url: str,
                       what: str, retries: int | None = None, backoff: float = 0.1) -> T:
    """``fn(limit)``, retried on transient errors within ``deadline`` seconds; our errors only.

    ``fn`` makes one attempt and must give up after ``limit`` seconds: ``timeout`` for a single
    request (a stat), or the time left before ``deadline`` when ``timeout`` is ``None`` (a
    listing, all its pages; each request is bounded by the backend's own timeout, set by
    :func:`filesystem`). Retries wait a jittered exponential backoff; none starts after
    ``deadline``, so the whole call ends within about ``deadline`` (+ one ``timeout``);
    ``retries`` (``None``: no cap) caps the attempts too.
    """
    start = time.monotonic()
    for attempt in itertools.count():
        left = max(deadline - (time.monotonic() - start), 0.5)
        try:
            return fn(left if timeout is None else min(timeout, left))
        except Exception as exc:
            err = translate_error(exc, url, what)
        pause = min(backoff * 2 ** attempt, 10.0) * random.uniform(0.5, 1.0)
        if not _transient(err) or attempt == retries or time.monotonic() - start + pause >= deadline:
            if attempt:
                err.message += f" (after {attempt + 1} attempts in {time.monotonic() - start:.1f} s)"
            raise err from err.__cause__
        time.sleep(pause)
    raise AssertionError("unreachable")  # itertools.count() never ends
