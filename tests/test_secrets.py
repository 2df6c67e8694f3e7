"""No secret in any output: planted passwords, keys, signatures and tokens never show in
errors (``str``, ``repr``, tracebacks, through DataLoader workers), log lines, ``repr(dataset)``,
samples' ``__url__`` or ``streamdata ls``."""

from __future__ import annotations

import contextlib
import gc
import http.server
import json
import logging
import os
import pickle
import re
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator

import pytest
import torch

import streamdata as sd
from streamdata.redact import redact, redact_url
from tests.helpers import make_samples, tar_bytes

PASSWORD = "S3CR3T-PW"
KEY_ID = "AKIAPLANTEDKEY000001"
SECRET = "planted-secret-0123456789abcdef"
SIGNATURE = "deadbeefplantedsig"
TOKEN = "PLANTEDTOKENvalue"
# what must never be seen (the key id's tail: "AKIA***" may stay, it says which kind of key)
PLANTED = (PASSWORD, "PLANTEDKEY", SECRET, SIGNATURE, TOKEN)


def assert_clean(*texts: object) -> None:
    for text in texts:
        text = str(text)
        for secret in PLANTED:
            assert secret not in text, f"{secret!r} leaked into: {text[:2000]}"


def error_texts(err: BaseException) -> list[str]:
    """Everything a user can print of an error."""
    return [str(err), repr(err), str(getattr(err, "url", "")),
            "".join(traceback.format_exception(err)), repr(pickle.loads(pickle.dumps(err)))]


def loader_error(loader) -> tuple[BaseException, list[str]]:
    """The error iterating ``loader`` raised and its texts (traceback included), then the
    traceback dropped (its frames keep the workers alive) and the workers gone."""
    caught, texts = None, []
    try:
        for _ in loader:
            pass
    except sd.StreamDataError as exc:
        texts = error_texts(exc)
        caught = exc.with_traceback(None)
    gc.collect()
    assert caught is not None, "no error reached the training loop"
    return caught, texts


# --------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("text, kept", [
    (f"http://user:{PASSWORD}@127.0.0.1:9/a.tar", "http://user:***@127.0.0.1:9/a.tar"),
    (f"see 'https://{TOKEN}@host/x' now", "see 'https://***@host/x' now"),
    (f"http://h/a.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={KEY_ID}%2F20240101%2Fus"
     f"&X-Amz-Date=20240101T000000Z&X-Amz-Security-Token={TOKEN}&X-Amz-Signature={SIGNATURE}",
     "http://h/a.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
     "&X-Amz-Date=20240101T000000Z&X-Amz-Security-Token=***&X-Amz-Signature=***"),
    (f"https://g/b/o?X-Goog-Credential=sa%40p%2F2024&X-Goog-Signature={SIGNATURE}",
     "https://g/b/o?X-Goog-Credential=***&X-Goog-Signature=***"),
    (f"https://acct.blob.core.windows.net/c/b.tar?sv=2022-11-02&sig={SIGNATURE}&se=x",
     "https://acct.blob.core.windows.net/c/b.tar?sv=2022-11-02&sig=***&se=x"),
    (f"<Code>SignatureDoesNotMatch</Code><AWSAccessKeyId>{KEY_ID}</AWSAccessKeyId>"
     f"<SignatureProvided>{SIGNATURE}</SignatureProvided><CanonicalRequest>GET\n/b/k\n"
     f"X-Amz-Credential={KEY_ID}",  # cut short inside an element, as a truncated body is
     "<Code>SignatureDoesNotMatch</Code><AWSAccessKeyId>***</AWSAccessKeyId>"
     "<SignatureProvided>***</SignatureProvided><CanonicalRequest>***"),
    (f"{{'Authorization': 'AWS4-HMAC-SHA256 Credential={KEY_ID}/x, Signature={SIGNATURE}', "
     "'Range': 'bytes=0-1'}", "{'Authorization': '***', 'Range': 'bytes=0-1'}"),
    (f"aws_secret_access_key={SECRET} {{\"secret\": \"{SECRET}\"}} id {KEY_ID}.",
     'aws_secret_access_key=*** {"secret": "***"} id AKIA***.'),
    ("SignatureDoesNotMatch: The request signature we calculated does not match [key: s01]",
     "SignatureDoesNotMatch: The request signature we calculated does not match [key: s01]"),
    ("s3://bkt/train-{000..009}.tar hdfs://nn:8020/x Asiapacificregionnumber1",
     "s3://bkt/train-{000..009}.tar hdfs://nn:8020/x Asiapacificregionnumber1"),
    # gcsfs's token methods are no secret (the GCS hint shows one); a real token is
    ("pass storage_options={'token': 'anon'}; token=google_default; {'token': 'ya29.a0Af-x'}",
     "pass storage_options={'token': 'anon'}; token=google_default; {'token': '***'}"),
    # Hugging Face tokens, wherever they stand; hf_ names stay (a Hub URL's file, a short word)
    (f"HF_TOKEN is hf_{TOKEN}0123456789 (401) hf://datasets/o/n/hf_data/x.tar hf_short",
     "HF_TOKEN is hf_*** (401) hf://datasets/o/n/hf_data/x.tar hf_short"),
])
def test_redaction_rules(text, kept):
    assert redact(text) == kept
    assert redact(kept) == kept  # idempotent


def test_redact_url_passes_none_and_plain_urls():
    assert redact_url(None) is None
    assert redact_url("s3://bkt/a.tar") == "s3://bkt/a.tar"


# --------------------------------------------------------------------------- HTTP with a password


@pytest.fixture
def http_shards(http_server, tmp_path):
    """A good, a corrupt and a missing shard behind ``http://user:PASSWORD@...``; the test
    server ignores the Authorization header aiohttp sends for the userinfo."""
    samples = make_samples([4, 3])
    (tmp_path / "good-0.tar").write_bytes(tar_bytes(samples[0]))
    (tmp_path / "good-1.tar").write_bytes(tar_bytes(samples[1]))
    (tmp_path / "bad.tar").write_bytes(tar_bytes(samples[0])[:700])
    server = http_server(tmp_path)
    base = f"http://user:{PASSWORD}@127.0.0.1:{server.port}"
    return {name: f"{base}/{name}.tar" for name in ("good-0", "good-1", "bad", "missing")}


def test_http_password_read_repr_and_url(http_shards):
    ds = sd.TarDataset([http_shards["good-0"], http_shards["good-1"]])
    samples = list(ds)
    assert len(samples) == 7
    assert {s["__url__"] for s in samples} == {redact_url(http_shards["good-0"]),
                                               redact_url(http_shards["good-1"])}
    assert samples[0]["__url__"].startswith("http://user:***@127.0.0.1:")
    assert ds.shards[0].url == http_shards["good-0"]  # the real URL stays in the shard list
    assert_clean(repr(ds), *(s["__url__"] for s in samples))


@pytest.mark.parametrize("shard", ["bad", "missing"])
def test_http_password_errors_in_process(http_shards, shard):
    """REDACTED-AT-BIRTH: the error's ``url`` attribute and every text of it are redacted."""
    ds = sd.TarDataset([http_shards[shard]], retries=0)
    with pytest.raises(sd.StreamDataError) as info:
        list(ds)
    assert info.value.url.startswith("http://user:***@")
    assert_clean(*error_texts(info.value))


def test_http_password_errors_through_workers(http_shards):
    ds = sd.TarDataset([http_shards[n] for n in ("good-0", "bad", "missing", "good-1")], retries=0)
    err, texts = loader_error(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert "Original Traceback" in str(err)  # torch's text, rebuilt in this process
    assert err.url.startswith("http://user:***@")
    assert_clean(*texts)


def test_skip_warnings_are_clean(http_shards, caplog):
    ds = sd.TarDataset([http_shards[n] for n in ("good-0", "bad", "missing")], retries=0,
                       on_error="skip")
    with caplog.at_level(logging.DEBUG, logger="streamdata"):
        assert len(list(ds)) == 4
    assert ds.skipped["format"] + ds.skipped["fetch"] == 2
    assert caplog.records and "***" in caplog.text
    assert_clean(caplog.text, *(r.getMessage() for r in caplog.records))


def test_logger_redacts_any_line(caplog):
    with caplog.at_level(logging.INFO, logger="streamdata"):
        logging.getLogger("streamdata").info("wrote %s", f"http://u:{PASSWORD}@h/x?sig={SIGNATURE}")
    assert caplog.records[0].getMessage() == "wrote http://u:***@h/x?sig=***"


def test_presigned_http_urls(http_shards, tmp_path):
    """Signed URLs as plain http:// URLs (S3, GCS, Azure style) read like any URL (a "?" is a
    query there, not a glob), and no signature or token shows."""
    base = http_shards["good-0"].replace(f"user:{PASSWORD}@", "")
    signed = [f"{base}?X-Amz-Credential={KEY_ID}%2F20240101%2Fus-east-1%2Fs3%2Faws4_request"
              f"&X-Amz-Security-Token={TOKEN}&X-Amz-Signature={SIGNATURE}",
              f"{base}?X-Goog-Credential=sa%40p.iam%2F2024&X-Goog-Signature={SIGNATURE}",
              f"{base}?sv=2022-11-02&sig={SIGNATURE}"]
    for url in signed:
        for make in (sd.TarDataset, sd.ObjectDataset):
            ds = make([url], retries=0)
            assert_clean(repr(ds))
            samples = list(ds) if make is sd.TarDataset else [ds[0]]
            getattr(ds, "close", lambda: None)()  # ObjectDataset's I/O thread
            assert samples and all(s["__url__"].startswith(base) for s in samples)
            assert_clean(*(s["__url__"] for s in samples))


# --------------------------------------------------------------------------- S3 credentials


@pytest.fixture
def planted_s3(s3_bucket):
    server, bucket = s3_bucket
    client = server.boto3_client()
    data = tar_bytes(make_samples([3])[0])
    for i in range(2):
        client.put_object(Bucket=bucket, Key=f"p/a-{i}.tar", Body=data)
    options = dict(server.storage_options, key=KEY_ID, secret=SECRET)
    if os.environ.get("STREAMDATA_TEST_S3_ENDPOINT"):  # a real server checks them
        pytest.skip("planted credentials need moto, which accepts any")
    return client, bucket, options


def test_s3_planted_credentials(planted_s3):
    client, bucket, options = planted_s3
    with pytest.raises(sd.ShardNotFoundError) as info:
        sd.TarDataset(f"s3://{bucket}/p/a-{{0..2}}.tar", storage_options=options)
    assert_clean(*error_texts(info.value))
    ds = sd.TarDataset(f"s3://{bucket}/p/a-{{0..1}}.tar", storage_options=options, retries=0)
    assert_clean(repr(ds), *(s["__url__"] for s in ds))
    client.delete_object(Bucket=bucket, Key="p/a-1.tar")  # gone after the listing
    err, texts = loader_error(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert isinstance(err, sd.ShardNotFoundError)
    assert_clean(*texts)


_SIGNATURE_DOES_NOT_MATCH = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SignatureDoesNotMatch</Code>'
    "<Message>The request signature we calculated does not match the signature you provided."
    "</Message><AWSAccessKeyId>{key}</AWSAccessKeyId><StringToSign>AWS4-HMAC-SHA256\n"
    "20240101T000000Z\n20240101/us-east-1/s3/aws4_request\n0f0f</StringToSign>"
    "<SignatureProvided>{signature}</SignatureProvided><CanonicalRequest>GET\n{path}\n{query}"
    "</CanonicalRequest><RequestId>1</RequestId></Error>")


class _DenyingS3(http.server.BaseHTTPRequestHandler):
    """Lists ``deny/a-0.tar`` in any bucket but ``all``; answers every other request 403
    with S3's SignatureDoesNotMatch body, which echoes the key id and the signed request."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):
        pass

    def do_GET(self):
        path, _, query = self.path.partition("?")
        if "list-type=2" in query and not path.startswith("/all"):
            body = (b"<ListBucketResult><Name>b</Name><KeyCount>1</KeyCount><IsTruncated>false"
                    b"</IsTruncated><Contents><Key>deny/a-0.tar</Key><Size>10240</Size></Contents>"
                    b"</ListBucketResult>")
            return self._send(200, body)
        sent = query + " " + self.headers.get("Authorization", "")
        key = re.search(r"Credential=([^/%]+)", sent)
        sig = re.search(r"Signature=(\w+)", sent)
        body = _SIGNATURE_DOES_NOT_MATCH.format(key=key.group(1) if key else "", path=path,
                                                signature=sig.group(1) if sig else "", query=query)
        self._send(403, body.encode())

    do_HEAD = do_GET

    def _send(self, status, body):
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


@pytest.fixture
def denying_s3() -> Iterator[dict]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DenyingS3)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield {"endpoint_url": f"http://127.0.0.1:{server.server_address[1]}", "key": KEY_ID,
               "secret": SECRET, "token": TOKEN, "client_kwargs": {"region_name": "us-east-1"},
               "config_kwargs": {"s3": {"addressing_style": "path"}}}
    finally:
        server.shutdown()
        thread.join(5)
        server.server_close()


def test_s3_signature_does_not_match(denying_s3):
    """The error body echoes the key id and the signed request: none of it shows."""
    with pytest.raises(sd.AccessDeniedError) as info:  # the listing is refused
        sd.TarDataset("s3://all/deny/a-{0..1}.tar", storage_options=denying_s3)
    assert_clean(*error_texts(info.value))
    ds = sd.TarDataset("s3://b/deny/a-{0..0}.tar", storage_options=denying_s3, retries=0)
    for loader in (ds, torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)):
        err, texts = loader_error(loader)  # the presigned GET is refused
        assert isinstance(err, sd.AccessDeniedError)
        assert "AWSAccessKeyId>***" in str(err)  # the body was quoted, redacted
        assert_clean(*texts)


# --------------------------------------------------------------------------- the command


def _ls(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamdata.cli", "ls", *args],
                          capture_output=True, text=True, timeout=120)


def test_ls_lists_urls_without_passwords(http_shards):
    done = _ls(http_shards["good-0"])
    assert done.returncode == 0 and "http://user:***@127.0.0.1:" in done.stdout
    assert_clean(done.stdout, done.stderr)


@pytest.mark.slow
def test_ls_errors_without_key_ids(denying_s3):
    done = _ls("s3://all/deny/a-{0..1}.tar", "--storage-options", json.dumps(denying_s3))
    assert done.returncode == 2 and "access denied" in done.stderr
    assert_clean(done.stdout, done.stderr)


def test_error_chained_to_a_secret_keeps_type_not_text():
    """A backend error whose text quotes a presigned URL, chained with ``from``: the
    traceback prints it redacted, and it keeps its type for ``except`` clauses
    (REDACTED-AT-BIRTH)."""
    cause = ConnectionError(f"GET http://h/k?X-Amz-Credential={KEY_ID}&X-Amz-Signature={SIGNATURE}")
    with pytest.raises(sd.ShardFetchError) as info:
        with contextlib.suppress(KeyError):
            try:
                raise cause
            except ConnectionError as exc:
                raise sd.ShardFetchError(f"cannot read: {exc}", url="http://h/k") from exc
    assert info.value.__cause__ is cause and isinstance(info.value.__cause__, ConnectionError)
    assert_clean(*error_texts(info.value))
