"""Presigned URLs that expire, credentials that expire, and the re-signs they cost, counted
(PRESIGN-LIFETIME, RESIGN-ON-STALE and RESIGN-COUNTED in ``streamdata.store.presigned``).

What moto's S3 server checks, verified here (``test_moto_checks_no_presigned_url_and_the_front_does``)
against moto 5.2.5 in its default mode, the one ``S3Server`` runs: nothing. A URL signed with
``ExpiresIn=1`` (SigV4 or SigV2) and fetched 2 s later is answered 200 with the object; so is
one whose signature was altered, and one signed with a session token nobody issued (with the
server's keys, or with keys it never heard of). Its IAM checks, off by default
(``INITIAL_NO_AUTH_ACTION_COUNT``), read only the ``Authorization`` header, never a query
string's signature, expiry or token (by its source: ``moto/core/authorization.py``,
``moto/iam/access_control.py``). So these tests put a front on loopback between the client
and moto (``benchmarks.faults.FaultProxy``, a real HTTP/1.1 proxy) whose rules refuse what S3
refuses, with S3's own answers: a URL past its end (SigV4: ``X-Amz-Date`` + ``X-Amz-Expires``;
SigV2, what botocore's S3 presigner makes by default: ``Expires``), by the front's clock,
which a test may move on (``skew``), gets 403 ``AccessDenied`` "Request has expired"; a
session token past the ``Expiration`` its ``credential_process`` gave it gets 400
``ExpiredToken``, one never issued 400 ``InvalidToken``.

Rules of this module: a test shows re-signing by what reached the front (the ``X-Amz-Date``,
``X-Amz-Expires`` and token of every URL sent, the refusals), not only by the client's counts;
each run that has to outlive a lifetime or an expiry lasts a few seconds, no more.
"""

from __future__ import annotations

import calendar
import collections
import shlex
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import streamdata as sd
from benchmarks.faults import Fault, FaultProxy, s3_error_xml
from streamdata.config import FetchConfig
from streamdata.store import backends
from streamdata.store.client import AsyncClient
from streamdata.store.presigned import PresignedS3, _not_the_signature, stale_answer
from streamdata.testing import S3Server
from tests.helpers import write_shards

KiB = 1 << 10

_EXPIRED = s3_error_xml("AccessDenied", "Request has expired")
_EXPIRED_TOKEN = s3_error_xml("ExpiredToken", "The provided token has expired.")
_INVALID_TOKEN = s3_error_xml("InvalidToken", "The provided token is malformed or otherwise invalid.")


class Front:
    """The checking front (see the module's docstring) and what reached it.

    ``sent``: ``(path, query, arrival)`` of every signed request, in order (``arrival``: this
    machine's ``time.time()`` when it reached the front); ``refused``: refusals by
    why; ``issued``: where a ``credential_process`` wrote ``token expiry`` lines (``None``:
    tokens are not checked); ``skew``: seconds the front's clock is ahead of this machine's."""

    def __init__(self, proxy: FaultProxy, issued: Path | None = None) -> None:
        self.proxy = proxy
        self.url = proxy.url
        self.issued = issued
        self.skew = 0.0
        self.sent: list[tuple[str, dict[str, str], float]] = []
        self.refused: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # the rules run on the proxy's thread; tests read here
        # the first rule that matches answers; each records what it refused
        proxy.add(Fault("status", status=403, body=_EXPIRED, match=self._url_expired, times=None))
        proxy.add(Fault("status", status=400, body=_INVALID_TOKEN, match=self._token_unknown, times=None))
        proxy.add(Fault("status", status=400, body=_EXPIRED_TOKEN, match=self._token_expired, times=None))

    def _url_expired(self, method: str, path: str, query: str) -> bool:
        q = dict(urllib.parse.parse_qsl(query))
        if "X-Amz-Signature" not in q and "Signature" not in q:
            return False
        with self._lock:
            self.sent.append((path, q, time.time()))
        return self._refuse("expired", time.time() + self.skew > _ends(q))

    def _tokens(self) -> dict[str, float]:
        assert self.issued is not None
        lines = self.issued.read_text().split("\n") if self.issued.exists() else []
        return {token: float(expiry) for token, expiry in (line.split() for line in lines if line)}

    def _token_unknown(self, method: str, path: str, query: str) -> bool:
        if self.issued is None:
            return False
        token = _token(dict(urllib.parse.parse_qsl(query)))
        return self._refuse("invalid token", token not in self._tokens())

    def _token_expired(self, method: str, path: str, query: str) -> bool:
        if self.issued is None:
            return False
        token = _token(dict(urllib.parse.parse_qsl(query)))
        assert token is not None  # _token_unknown refused it otherwise
        return self._refuse("expired token", time.time() + self.skew > self._tokens()[token])

    def _refuse(self, why: str, refuse: bool) -> bool:
        if refuse:
            with self._lock:
                self.refused[why] += 1
        return refuse

    def gets(self, key: str) -> list[dict[str, str]]:
        """The query of every signed GET of ``key`` (``bucket/key``) that reached the front."""
        return [q for q, _ in self.arrivals(key)]

    def arrivals(self, key: str) -> list[tuple[dict[str, str], float]]:
        """``(query, arrival)`` of every signed GET of ``key`` that reached the front."""
        with self._lock:
            return [(q, at) for path, q, at in self.sent if path.lstrip("/") == key]


def _born(query: dict[str, str]) -> int:
    """A SigV4 URL's X-Amz-Date, as a Unix time."""
    return calendar.timegm(time.strptime(query["X-Amz-Date"], "%Y%m%dT%H%M%SZ"))


def _ends(query: dict[str, str]) -> int:
    """When a presigned URL expires, as a Unix time: SigV4's X-Amz-Date + X-Amz-Expires, SigV2's
    (botocore's default for S3) Expires. Both count whole seconds, so a URL signed for ``n``
    seconds lives between ``n - 1`` and ``n``."""
    return _born(query) + int(query["X-Amz-Expires"]) if "X-Amz-Date" in query else int(query["Expires"])


def _token(query: dict[str, str]) -> str | None:
    """A URL's session token: SigV4's X-Amz-Security-Token, SigV2's x-amz-security-token."""
    return query.get("X-Amz-Security-Token") or query.get("x-amz-security-token")


@pytest.fixture
def front(s3_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Front, Any, str]]:
    """``(front, server, bucket)``: a checking front to a fresh bucket. The signer cache starts
    empty (SIGNER-REUSE: a front may get an earlier front's port, and with it its options)."""
    monkeypatch.setattr(backends, "_SIGNERS", {})
    server, bucket = s3_bucket
    with FaultProxy(server.endpoint_url) as proxy:
        yield Front(proxy), server, bucket


def _lite_options(server: Any, front: Front) -> dict[str, Any]:
    """LITE-S3's options (static keys, an endpoint): the front's endpoint."""
    return {**server.storage_options, "endpoint_url": front.url}


# ---- the pieces, without a network --------------------------------------------------------

def test_the_lifetime_setting_is_whole_seconds_from_1_s_to_7_days(monkeypatch: pytest.MonkeyPatch) -> None:
    assert FetchConfig().presign_lifetime == 900
    assert FetchConfig(presign_lifetime=1).presign_lifetime == 1
    assert FetchConfig(presign_lifetime=604800).presign_lifetime == 604800
    assert FetchConfig(presign_lifetime=60.0).presign_lifetime == 60  # type: ignore[arg-type]
    for bad in (0, -5, 604801, 0.5, 1.5, True, "900", None):
        with pytest.raises(sd.SpecError, match="presign_lifetime"):
            FetchConfig(presign_lifetime=bad)  # type: ignore[arg-type]
    with pytest.raises(sd.SpecError, match="presign_lifetime"):
        FetchConfig.resolve(presign_lifetime=0)
    monkeypatch.setenv("STREAMDATA_PRESIGN_LIFETIME", "120")
    assert FetchConfig.from_env().presign_lifetime == 120
    monkeypatch.setenv("STREAMDATA_PRESIGN_LIFETIME", "604801")
    with pytest.raises(sd.SpecError, match="STREAMDATA_PRESIGN_LIFETIME"):
        FetchConfig.from_env()
    with pytest.raises(sd.SpecError, match="presign_lifetime"):
        PresignedS3(None, 1, lifetime=0)


@pytest.mark.parametrize(("status", "body", "code"), [
    (403, _EXPIRED, "RequestExpired"),
    (403, s3_error_xml("AccessDenied", "request has expired"), "RequestExpired"),
    (400, _EXPIRED_TOKEN, "ExpiredToken"),
    (403, _EXPIRED_TOKEN, "ExpiredToken"),
    (400, s3_error_xml("TokenRefreshRequired", "The provided token must be refreshed."),
     "TokenRefreshRequired"),
    (403, s3_error_xml("SignatureDoesNotMatch", "The request signature we calculated..."),
     "SignatureDoesNotMatch"),
    (403, s3_error_xml("AccessDenied", "Access Denied"), None),  # the object's answer
    (400, _INVALID_TOKEN, None),  # a token that never worked: a new signature cannot help
    (500, _EXPIRED_TOKEN, None),  # the server's trouble, retried as such
    (404, s3_error_xml("NoSuchKey", "Request has expired"), None),
])
def test_answers_a_fresh_signature_fixes_are_told_by_code_and_message(status: int, body: bytes,
                                                                      code: str | None) -> None:
    assert stale_answer(status, body) == code
    # LITE-S3: an AccessDenied is the object's answer, unless it says the URL expired
    assert _not_the_signature(status, body) == (status == 404 or (status == 403 and b"AccessDenied" in body
                                                                  and code is None))


# ---- against the S3 server, through the checking front -------------------------------------

def test_moto_checks_no_presigned_url_and_the_front_does(front: tuple[Front, Any, str]) -> None:
    """What the module's docstring says of moto, and that the front refuses an expired URL
    with S3's answer. Fails, and says so, the day moto starts to check."""
    import boto3
    from botocore.config import Config

    fr, server, bucket = front
    if not isinstance(server, S3Server):
        pytest.skip("checks moto's own behaviour; the endpoint is another server")
    server.boto3_client().put_object(Bucket=bucket, Key="k", Body=b"hello")

    def client(endpoint: str, key: str, token: str | None = None, version: str = "s3v4") -> Any:
        return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=key,
                            aws_session_token=token, region_name=server.region,
                            config=Config(signature_version=version, s3={"addressing_style": "path"}))

    def get(url: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    params = {"Bucket": bucket, "Key": "k"}
    via_front = [client(fr.url, server.key, version=v).generate_presigned_url("get_object", Params=params,
                                                                               ExpiresIn=3)
                 for v in ("s3v4", "s3")]  # SigV4, and SigV2: what botocore's S3 presigner makes by default
    for url in via_front:  # signed for 3 s: at least 2 s to live (_ends), however late in its second
        assert get(url) == (200, b"hello")  # the front passes a live URL on
    ends = max(_ends(dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))) for url in via_front)
    time.sleep(max(0.0, ends - time.time()) + 0.2)
    for url in via_front:
        direct = url.replace(fr.url, server.endpoint_url, 1)
        assert get(direct) == (200, b"hello"), "moto now refuses expired URLs: update the module docstring"
        status, body = get(url)
        assert status == 403 and stale_answer(status, body) == "RequestExpired"
    assert fr.refused == {"expired": 2}
    direct = via_front[0].replace(fr.url, server.endpoint_url, 1)
    tampered = direct[: direct.index("X-Amz-Signature=") + 16] + "0" * 64
    assert get(tampered) == (200, b"hello")
    for key in (server.key, "AKIDNOBODYISSUED"):
        url = client(server.endpoint_url, key, "a-token-nobody-issued").generate_presigned_url(
            "get_object", Params=params, ExpiresIn=60)
        assert "X-Amz-Security-Token=a-token-nobody-issued" in url
        assert get(url) == (200, b"hello"), "moto now checks session tokens: update the module docstring"


def test_a_run_longer_than_the_lifetime_re_signs_by_age_and_reads_every_sample_once(
        front: tuple[Front, Any, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """PRESIGN-LIFETIME and RESIGN-COUNTED ("age"): LITE-S3, lifetime 2 s, a 4.5 s read of small
    parts under a small byte budget: the same shards' URLs are needed again and again, and are
    re-signed before the front would refuse them (it refuses none), every sample arriving once."""
    import s3fs

    fr, server, bucket = front
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    keys = write_shards(fs, f"{bucket}/data", [15, 15, 15], floats=2048)  # ~10 KiB per sample
    ds = sd.TarDataset(f"s3://{bucket}/data/shard-{{000..002}}.tar",
                       storage_options=_lite_options(server, fr), decode=False, part_size=16 * KiB,
                       first_part=16 * KiB, byte_budget=32 * KiB, presign_lifetime=2)
    began, got = time.monotonic(), []
    try:
        for sample in ds:
            got.append(sample["__key__"])
            time.sleep(0.1)  # a slow consumer: the reader fetches the shards' parts over 4.5 s
    finally:
        close = getattr(ds, "close", None)
        if close is not None:
            close()
    assert time.monotonic() - began > 4
    assert sorted(got) == sorted(keys) and len(got) == len(set(got))
    # the shards' GETs (not the listing's, nor the index lookup's: signed for one request each)
    sent = [each for i in range(3) for each in fr.arrivals(f"{bucket}/data/shard-{i:03d}.tar")]
    assert sent and {q["X-Amz-Expires"] for q, _ in sent} == {"2"}  # signed for the lifetime asked
    assert not fr.refused, fr.refused  # never sent past its end
    # reused up to half its life (1 s) after the second it carries, and a trip (slack for a
    # busy machine): never, as a whole lifetime would allow, up to 2 s
    oldest = max(at - _born(q) for q, at in sent)
    assert oldest < 1.4, oldest
    resigned = ds.resigned  # the dataset's counters, over every process that read
    assert resigned["age"] > 0 and resigned["expired"] == resigned["refused"] == 0
    # what the front saw: some shard's GETs came with more than one X-Amz-Date
    assert max(len({q["X-Amz-Date"] for q in fr.gets(f"{bucket}/data/shard-{i:03d}.tar")})
               for i in range(3)) > 1


_CREDENTIAL_PROCESS = """
import datetime, json, sys, time, uuid
issued, key, secret, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
expiry = time.time() + seconds
token = "tok-" + uuid.uuid4().hex
with open(issued, "a") as f:
    f.write(f"{token} {expiry!r}\\n")
print(json.dumps({"Version": 1, "AccessKeyId": key, "SecretAccessKey": secret, "SessionToken": token,
                  "Expiration": datetime.datetime.fromtimestamp(expiry, datetime.timezone.utc).isoformat()}))
"""


def test_credentials_from_a_credential_process_are_refreshed_and_no_url_outlives_them(
        s3_bucket: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """PRESIGN-LIFETIME (the credentials' expiry) and RESIGN-ON-STALE (ExpiredToken): botocore's
    path (no keys in the options: a profile's ``credential_process``), session
    tokens that live 3 s, objects read part by part over 6 s with the default lifetime
    (900 s: half of it is far away). The front refuses a token past its expiry; none is
    sent past it: URLs are re-signed before their credentials expire, with refreshed ones
    (the process ran again). Then an ExpiredToken answer (400, as S3 sends it) is re-signed
    once, and counted."""
    server, bucket = s3_bucket
    blobs = {f"obj-{i}": bytes([i]) * (24 * KiB) for i in range(3)}
    admin = server.boto3_client()  # before the profile is set: it has static keys
    for name, blob in blobs.items():
        admin.put_object(Bucket=bucket, Key=name, Body=blob)
    issued = tmp_path / "issued"
    script = tmp_path / "creds.py"
    script.write_text(_CREDENTIAL_PROCESS)
    command = " ".join(shlex.quote(part) for part in (sys.executable, "-I", "-S", str(script), str(issued),
                                                       server.key, server.secret, "3"))
    config = tmp_path / "config"
    config.write_text(f"[profile sd-expiring]\ncredential_process = {command}\nregion = {server.region}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_PROFILE",
                 "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_PROFILE", "sd-expiring")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # a fresh botocore session reads this profile; signers made under it are not kept
    monkeypatch.setattr(backends, "_S3_SESSIONS", {})
    monkeypatch.setattr(backends, "_SIGNERS", {})

    with FaultProxy(server.endpoint_url) as proxy:
        fr = Front(proxy, issued)
        options = {"endpoint_url": fr.url, "config_kwargs": {"s3": {"addressing_style": "path"}}}
        client = AsyncClient("s3", options)
        try:
            began, step = time.monotonic(), 1 * KiB
            for n in range(24):  # a part of every object each 0.25 s: 6 s
                for name, blob in blobs.items():
                    got = client.io.run(client.get(f"s3://{bucket}/{name}", n * step, (n + 1) * step), 30)
                    assert got == blob[n * step:(n + 1) * step]
                time.sleep(max(0.0, began + 0.25 * (n + 1) - time.monotonic()))
            presigned = client._presigned
            assert presigned is not None and presigned.lite is False  # botocore signed
            tokens = fr._tokens()
            first_expiry = min(tokens.values())
            assert time.time() > first_expiry + 1  # the run outlived the first credentials
            assert len(tokens) >= 2  # the credential process ran again: refreshed
            used = [_token(q) for _, q, _ in fr.sent]
            assert len(set(used)) >= 2 and set(used) <= set(tokens)
            assert not fr.refused, fr.refused  # no URL outlived its credentials
            assert presigned.resigned_by.get("age", 0) >= 2  # re-signed for the credentials, not the lifetime
            assert client.stats.retries == 0

            # an ExpiredToken answer the client could not foresee (a revoked session, a clock
            # ahead): re-signed once, counted, read
            before = dict(presigned.resigned_by)
            gets = proxy.requests.get("get", 0)
            proxy.clear()  # the front's rules off; one S3 ExpiredToken answer instead
            proxy.add(Fault("status", status=400, body=_EXPIRED_TOKEN, match="get", times=1))
            got = client.io.run(client.get(f"s3://{bucket}/obj-0", 0, 100), 30)
            assert got == blobs["obj-0"][:100]
            assert proxy.requests["get"] == gets + 2
            assert presigned.resigned_by.get("expired", 0) == before.get("expired", 0) + 1
            assert client.stats.retries == 0
        finally:
            client.close()


def test_a_request_has_expired_answer_is_re_signed_once_and_counted(front: tuple[Front, Any, str]) -> None:
    """RESIGN-ON-STALE and RESIGN-COUNTED ("expired"): LITE-S3 with the default lifetime: the
    front's clock moves past the end of the URL it has seen; the URL is refused as expired,
    re-signed (a later X-Amz-Date) and accepted by the same rule. Refused again after that, it
    is an AccessDeniedError, not retried."""
    fr, server, bucket = front
    blob = bytes(range(256)) * 64
    server.boto3_client().put_object(Bucket=bucket, Key="a.bin", Body=blob)
    client = AsyncClient("s3", _lite_options(server, fr))
    url = f"s3://{bucket}/a.bin"
    try:
        assert client.io.run(client.get(url, 0, 1000), 30) == blob[:1000]
        first = fr.gets(f"{bucket}/a.bin")[-1]
        life = int(first["X-Amz-Expires"])
        assert life == 900  # FetchConfig's default, where nobody chose one
        while time.time() < _born(first) + 1.05:  # a new signature will carry a later second
            time.sleep(0.05)
        fr.skew = _born(first) + life + 0.5 - time.time()  # the first URL is 0.5 s past its end
        assert client.io.run(client.get(url, 1000, 2000), 30) == blob[1000:2000]
        again = fr.gets(f"{bucket}/a.bin")[-2:]
        assert again[0] == first and _born(again[1]) > _born(first)  # refused, then re-signed
        assert fr.refused == {"expired": 1}
        presigned = client._presigned
        assert presigned is not None and presigned.resigned_by == {"expired": 1}
        assert client.stats.retries == 0 and client.stats.requests == 2

        fr.skew = 10 * 86400.0  # now every URL is past its end: one re-sign, then the error
        gets = fr.proxy.requests["get"]
        with pytest.raises(sd.AccessDeniedError, match="a.bin"):
            client.io.run(client.get(url, 2000, 3000), 30)
        assert fr.proxy.requests["get"] == gets + 2
        assert presigned.resigned_by == {"expired": 2} and client.stats.retries == 0
    finally:
        client.close()


@pytest.mark.parametrize("reused", [False, True])
def test_an_access_denied_that_is_not_about_expiry_stays_permanent(front: tuple[Front, Any, str],
                                                                   reused: bool) -> None:
    """LITE-S3: the object's own AccessDenied fails at once, no retry; on a fresh URL with no
    re-sign at all; on a URL that worked before with the one re-sign any refusal of a used URL
    gets (credentials may have rotated without saying so), never counted as expired."""
    fr, server, bucket = front
    server.boto3_client().put_object(Bucket=bucket, Key="a.bin", Body=b"x" * 1000)
    client = AsyncClient("s3", _lite_options(server, fr))
    url = f"s3://{bucket}/a.bin"
    try:
        if reused:
            assert client.io.run(client.get(url, 0, 10), 30) == b"x" * 10
        gets = fr.proxy.requests.get("get", 0)
        fr.proxy.add(Fault("status", status=403, body=s3_error_xml("AccessDenied", "Access Denied"),
                           match="get", times=None))
        with pytest.raises(sd.AccessDeniedError, match="a.bin"):
            client.io.run(client.get(url, 10, 20), 30)
        presigned = client._presigned
        assert presigned is not None and client.stats.retries == 0
        assert fr.proxy.requests["get"] - gets == (2 if reused else 1)
        assert presigned.resigned_by == ({"refused": 1} if reused else {})
        assert not fr.refused
    finally:
        client.close()


def test_environment_credentials_are_not_kept_once_it_changes(s3_server, monkeypatch, tmp_path):
    """The process's botocore session resolves credentials once: a session made while the
    environment held keys must not serve a listing after they are gone."""
    opts = s3_server.storage_options
    bucket = "sd-env-keys"
    s3_server.create_bucket(bucket)
    try:
        endpoint_only = {k: v for k, v in opts.items() if k not in ("key", "secret", "token")}
        for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
        with pytest.raises(sd.ShardNotFoundError):  # signed: the server answers, nothing there
            sd.TarDataset(f"s3://{bucket}/train-{{0..1}}.tar", storage_options=endpoint_only)
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        with pytest.raises(sd.AccessDeniedError, match="Check credentials"):
            sd.TarDataset(f"s3://{bucket}/train-{{0..1}}.tar", storage_options=endpoint_only)
    finally:
        s3_server.delete_bucket(bucket)
