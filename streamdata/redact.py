"""Secrets out of every text a user can see: URLs, error messages, log lines, tracebacks.

:func:`redact` rewrites free text with one compiled regex, in one pass; :func:`redact_url`
is the same for a single URL (``None`` passes through). Each rule replaces only the secret,
with ``***``, and keeps what says where the problem is (scheme, host, path, parameter name):

- userinfo: ``scheme://user:password@host`` -> ``scheme://user:***@host`` (the user name
  stays: it says which account); a userinfo without a colon, the way tokens are passed
  (``https://TOKEN@host``), -> ``scheme://***@host``.
- signed-URL and credential parameters, in a query string or as ``name=value`` anywhere:
  any name containing ``signature``, ``credential``, ``token``, ``secret``, ``password``,
  ``passwd``, ``accesskey``/``access_key``, ``accessid`` or ``apikey``/``api_key`` (so
  ``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``, ``X-Goog-Signature``,
  ``X-Goog-Credential``, ``AWSAccessKeyId``, ``GoogleAccessId``, ``aws_secret_access_key``,
  ``aws_session_token``), and the short names ``sig`` (Azure SAS) and ``key`` after ``?``/``&``.
  Quoted, the same names followed by ``:`` too (``'aws_secret_access_key': '...'``, JSON);
  unquoted ``Name: text`` is prose (``SignatureDoesNotMatch: The request ...``) and stays;
  so do gcsfs's ``token`` methods (``anon``, ``google_default``, ``cache``, ``cloud``,
  ``browser``), which name how to find credentials, not credentials.
- ``Authorization`` / ``Proxy-Authorization`` header values, to the end of the line or quote.
- AWS access key ids: ``AKIA``/``ASIA`` and 12 or more capitals and digits.
- Hugging Face tokens: ``hf_`` and 20 or more letters and digits -> ``hf_***``.
- the contents of S3 error-body elements that echo credentials or the signed request:
  ``AWSAccessKeyId``, ``StringToSign``, ``StringToSignBytes``, ``SignatureProvided``,
  ``CanonicalRequest``, ``CanonicalRequestBytes`` (up to the next ``<``, so a body cut short
  in the middle of an element is redacted too).

Redacting is idempotent (``***`` is left as it is), so text redacted twice reads the same.
Where it is applied: :class:`~streamdata.errors.StreamDataError` (message, ``url``, and the
text of the exceptions it is chained to), the datasets' ``repr``, samples' ``__url__``, the
``streamdata`` logger (:class:`RedactFilter`) and the ``streamdata`` command (output and errors).
"""

from __future__ import annotations

import logging
import re

__all__ = ["MASK", "RedactFilter", "RedactedError", "redact", "redact_exception", "redact_url"]

MASK = "***"
# values of a secret-looking name that are no secret: gcsfs's ``token=`` methods, None
_NOT_SECRETS = frozenset({"anon", "google_default", "cache", "cloud", "browser", "none", "null", ""})

_SECRET_WORDS = (r"signature|credential|token|secret|password|passwd|access[-_]?key|accessid"
                 r"|api[-_]?key")
_ELEMENTS = ("AWSAccessKeyId|StringToSign|StringToSignBytes|SignatureProvided|CanonicalRequest"
             "|CanonicalRequestBytes")

_PATTERN = re.compile(
    # scheme://userinfo@ : up to the authority's last "@", as URL parsers read it
    r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)(?P<userinfo>[^/\s?#'\"<>]*)@"
    # <Element>secret</Element>, or cut short inside it
    rf"|(?P<element><(?:{_ELEMENTS})>)[^<]*"
    # Authorization: value (header dumps, dict reprs)
    r"|(?P<header>\b(?:Proxy-)?Authorization['\"]?\s*[:=]\s*['\"]?)[^'\"\r\n]*"
    # name=value, 'name': 'value', "name": "value" with a secret-looking name
    rf"|(?P<param>(?<![\w.-])[\w.-]*(?:{_SECRET_WORDS})[\w.-]*(?:=|['\"]\s*:\s*['\"]?))"
    r"(?P<value>[^\s&#'\"<>,;)}\]]*)"
    # ?sig=... &key=... (query strings only: "key" alone is too common a word)
    r"|(?P<short>[?&](?:sig|key)=)[^\s&#'\"<>]*"
    # Hugging Face tokens (case-sensitive)
    r"|(?P<hf>(?-i:(?<![A-Za-z0-9_])hf_))(?-i:[A-Za-z0-9]{20,})"
    # AWS access key ids (case-sensitive)
    r"|(?-i:(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{12,})",
    re.IGNORECASE,
)


def _replace(m: re.Match) -> str:
    if m.group("scheme") is not None:
        user, colon, _ = m.group("userinfo").partition(":")
        return f"{m.group('scheme')}{user}:{MASK}@" if colon else f"{m.group('scheme')}{MASK}@"
    for name in ("element", "header", "short", "hf"):
        if m.group(name) is not None:
            return m.group(name) + MASK
    if m.group("param") is not None:
        value = m.group("value")
        if value.lower() in _NOT_SECRETS:  # gcsfs's token= names a method: not a credential
            return m.group(0)
        return m.group("param") + (MASK if value else "")
    text = m.group(0)
    return text if text[:4].upper() not in ("AKIA", "ASIA") else text[:4] + MASK


def redact(text: str) -> str:
    """``text`` with every secret the module's rules know replaced by ``***``."""
    return _PATTERN.sub(_replace, text) if text else text


def redact_url(url: str | None) -> str | None:
    """``url`` without its password, token or signature (see the module's rules)."""
    return _PATTERN.sub(_replace, url) if url else url


class RedactFilter(logging.Filter):
    """A logger filter that redacts each record's formatted message (``msg % args``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it itself
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


class RedactedError(Exception):
    """Stands in, in a chain of causes, for an exception whose text carried a secret that
    could not be redacted in place (its ``__str__`` is computed); its text is the redacted
    ``module.Type: text`` of the original."""


_MAX_CHAIN = 32


def redact_exception(exc: BaseException | None, _seen: set[int] | None = None) -> BaseException | None:
    """``exc`` with its text, notes and chained causes redacted, for a traceback to print.

    The exception is edited in place (``args``, ``OSError``'s ``strerror`` and file names,
    ``__notes__``) so it keeps its type and attributes for ``except`` clauses and code that
    reads them; one whose ``str()`` still carries a secret afterwards is replaced by a
    :class:`RedactedError`. Our own errors redact themselves and are returned as they are.
    """
    if exc is None or getattr(exc, "_redacts_itself", False):
        return exc
    seen = set() if _seen is None else _seen
    if id(exc) in seen or len(seen) >= _MAX_CHAIN:
        return exc
    seen.add(id(exc))
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        exc.__notes__ = [redact(n) if isinstance(n, str) else n for n in notes]
    text = _text(exc)
    if redact(text) != text:
        for name in ("strerror", "filename", "filename2"):
            value = getattr(exc, name, None)
            if isinstance(value, str):
                setattr(exc, name, redact(value))
        try:
            exc.args = tuple(redact(a) if isinstance(a, str) else a for a in exc.args)
        except (AttributeError, TypeError):
            pass
        text = _text(exc)
        if redact(text) != text:
            kind = type(exc)
            clean = RedactedError(f"{kind.__module__}.{kind.__qualname__}: {redact(text)}")
            clean.__cause__, clean.__context__ = exc.__cause__, exc.__context__
            clean.__suppress_context__ = exc.__suppress_context__
            exc = clean
    for link in ("__cause__", "__context__"):
        inner = getattr(exc, link)
        clean_inner = redact_exception(inner, seen)
        if clean_inner is not inner:
            suppress = exc.__suppress_context__
            setattr(exc, link, clean_inner)
            exc.__suppress_context__ = suppress
    return exc


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # traceback prints "<exception str() failed>" for these
        return ""
