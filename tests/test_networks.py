"""Networks as companies run them (PROXY-ROUTE, TRUST in streamdata/store/network.py), end to end.

A real forward proxy on loopback (``streamdata.testing.ForwardProxy``: absolute-form and
``CONNECT``) is the only thing that can resolve ``bucket.corp.test`` (a reserved name no
resolver knows): a request that bypasses it fails. A TLS front (``TLSFront``) with a
certificate from a private authority serves https for ``127.0.0.1`` and that name. Through
them every sample arrives exactly once, in the main process and in forked DataLoader workers,
for S3 (keys in the options: our signer; keys from the environment: botocore), GCS, http://
and https:// URLs; the proxy's own log shows the requests went through it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import streamdata as sd
from streamdata.errors import ShardFetchError
from streamdata.testing import ForwardProxy, TLSFront, free_port
from tests.helpers import UNEVEN, read_keys, write_shards

NAME = "bucket.corp.test"  # resolved by the proxy only
REPO = Path(__file__).resolve().parents[1]
_VARS = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY",
         "no_proxy", "NO_PROXY", "AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR")


@pytest.fixture
def env(monkeypatch):
    """The test's environment, without the machine's proxy and trust settings."""
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def proxy():
    with ForwardProxy({NAME: "127.0.0.1"}) as server:
        yield server


def _renamed(url: str, host: str = NAME) -> str:
    """``url`` with its host replaced (the port kept)."""
    parts = urlsplit(url)
    return parts._replace(netloc=f"{host}:{parts.port}").geturl()


def _through(proxy: ForwardProxy, host: str = NAME) -> list[tuple[str, str]]:
    return [r for r in proxy.requests if host in r[1]]


@pytest.fixture
def s3_shards(s3_bucket):
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    keys = write_shards(fs, f"{bucket}/data")
    return server, f"s3://{bucket}/data/shard-{{000..{len(UNEVEN) - 1:03d}}}.tar", sorted(keys)


def _renamed_options(server, endpoint: str) -> dict:
    return dict(server.storage_options, endpoint_url=endpoint)


# ---- proxies ---------------------------------------------------------------------------------------


def test_s3_with_keys_in_the_options_through_http_proxy(s3_shards, proxy, env) -> None:
    """Our signer's listing, index probe and GETs, in the main process and two forked workers."""
    server, spec, keys = s3_shards
    env.setenv("HTTP_PROXY", proxy.url)
    options = _renamed_options(server, _renamed(server.endpoint_url))
    ds = sd.TarDataset(spec, storage_options=options, decode=False)
    assert sorted(read_keys(ds, 0)) == keys
    assert sorted(read_keys(ds, 2)) == keys
    sent = _through(proxy)
    assert any(method == "GET" and "list-type=2" in target for method, target in sent)  # the listing
    assert sum(method == "GET" and "shard-" in target for method, target in sent) >= len(UNEVEN)


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "http_proxy", "ALL_PROXY"])
def test_s3_with_environment_credentials_through_http_proxy(s3_shards, proxy, env, variable) -> None:
    """botocore lists (it reads HTTP_PROXY itself; ALL_PROXY is handed to it); the presigned
    GETs go through the proxy too."""
    server, spec, keys = s3_shards
    env.setenv(variable, proxy.url)
    env.setenv("AWS_ACCESS_KEY_ID", server.key)
    env.setenv("AWS_SECRET_ACCESS_KEY", server.secret)
    env.setenv("AWS_DEFAULT_REGION", server.region)
    options = {"endpoint_url": _renamed(server.endpoint_url),
               "config_kwargs": {"s3": {"addressing_style": "path"}}}
    ds = sd.TarDataset(spec, storage_options=options, decode=False, index=None)
    assert sorted(read_keys(ds, 2)) == keys
    presigned = [t for _, t in _through(proxy) if "shard-" in t and "Signature=" in t]
    assert len(presigned) >= len(UNEVEN) - 1  # every shard but the empty one, by its presigned URL


def test_s3_proxies_in_the_storage_options(s3_shards, proxy, env) -> None:
    server, spec, keys = s3_shards
    options = _renamed_options(server, _renamed(server.endpoint_url))
    options["config_kwargs"] = dict(options["config_kwargs"], proxies={"http": proxy.url})
    ds = sd.TarDataset(spec, storage_options=options, decode=False)
    assert sorted(read_keys(ds, 2)) == keys
    assert _through(proxy)


@pytest.mark.parametrize("given", ["environment", "storage_options"])
def test_gcs_through_http_proxy(gcs_bucket, proxy, env, given) -> None:
    import gcsfs

    server, bucket = gcs_bucket
    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **server.storage_options)
    keys = write_shards(fs, f"{bucket}/data")
    options = dict(server.storage_options, endpoint_url=_renamed(server.endpoint_url))
    if given == "environment":
        env.setenv("HTTP_PROXY", proxy.url)
    else:
        options["proxies"] = {"http": proxy.url}
    ds = sd.TarDataset(f"gs://{bucket}/data/", storage_options=options, decode=False)
    assert sorted(read_keys(ds, 2)) == sorted(keys)
    assert _through(proxy)


@pytest.mark.parametrize("given", ["environment", "storage_options"])
def test_http_urls_through_http_proxy(tmp_path, http_server, proxy, env, given) -> None:
    import fsspec

    keys = write_shards(fsspec.filesystem("file"), str(tmp_path))
    server = http_server(tmp_path)
    options = None
    if given == "environment":
        env.setenv("HTTP_PROXY", proxy.url)
    else:
        options = {"proxies": {"http": proxy.url}}
    urls = [_renamed(server.url(f"shard-{i:03d}.tar")) for i in range(len(UNEVEN))]
    ds = sd.TarDataset(urls, decode=False, index=None, storage_options=options)
    assert sorted(read_keys(ds, 2)) == sorted(keys)
    assert len(_through(proxy)) >= len(UNEVEN)


def test_https_urls_through_connect(tmp_path, http_server, proxy, env) -> None:
    import fsspec

    keys = write_shards(fsspec.filesystem("file"), str(tmp_path))
    server = http_server(tmp_path)
    with TLSFront(server.endpoint_url, names=[NAME]) as front:
        env.setenv("HTTPS_PROXY", proxy.url)
        env.setenv("SSL_CERT_FILE", front.ca_file)
        urls = [f"https://{NAME}:{front.port}/shard-{i:03d}.tar" for i in range(len(UNEVEN))]
        ds = sd.TarDataset(urls, decode=False, index=None)
        assert sorted(read_keys(ds, 2)) == sorted(keys)
    assert any(method == "CONNECT" and target == f"{NAME}:{front.port}" for method, target in proxy.requests)


@pytest.mark.parametrize(("trust", "keys_from"), [
    ("AWS_CA_BUNDLE", "options"), ("REQUESTS_CA_BUNDLE", "options"), ("verify", "options"),
    ("AWS_CA_BUNDLE", "environment"), ("REQUESTS_CA_BUNDLE", "environment")])
def test_https_s3_through_connect_with_a_private_ca(s3_shards, proxy, env, trust, keys_from) -> None:
    """Our signer (keys in the options) or botocore's (keys from the environment), through a
    CONNECT tunnel to a certificate only the named bundle trusts."""
    server, spec, keys = s3_shards
    with TLSFront(server.endpoint_url, names=[NAME]) as front:
        env.setenv("HTTPS_PROXY", proxy.url)
        options = _renamed_options(server, f"https://{NAME}:{front.port}")
        if keys_from == "environment":
            env.setenv("AWS_ACCESS_KEY_ID", options.pop("key"))
            env.setenv("AWS_SECRET_ACCESS_KEY", options.pop("secret"))
            env.setenv("AWS_DEFAULT_REGION", server.region)
        if trust == "verify":
            options["client_kwargs"] = dict(options["client_kwargs"], verify=front.ca_file)
        else:
            env.setenv(trust, front.ca_file)
        ds = sd.TarDataset(spec, storage_options=options, decode=False)
        assert sorted(read_keys(ds, 2)) == keys
    assert sum(method == "CONNECT" for method, _ in proxy.requests) >= 2  # main process and workers


def test_no_proxy_bypasses_a_dead_proxy(s3_shards, env) -> None:
    server, spec, keys = s3_shards
    dead = f"http://127.0.0.1:{free_port()}"
    host = urlsplit(server.endpoint_url).hostname
    env.setenv("HTTP_PROXY", dead)
    env.setenv("NO_PROXY", f"example.org,{host}")
    ds = sd.TarDataset(spec, storage_options=server.storage_options, decode=False)
    assert sorted(read_keys(ds, 2)) == keys


def test_a_dead_proxy_is_named_in_the_error(s3_shards, env) -> None:
    server, spec, _ = s3_shards
    port = free_port()
    env.setenv("HTTP_PROXY", f"http://user:hunter2@127.0.0.1:{port}")
    options = _renamed_options(server, _renamed(server.endpoint_url))
    with pytest.raises(sd.StreamDataError) as caught:
        sd.TarDataset(spec, storage_options=options, fetch_config=sd.FetchConfig(retry_deadline=2))
    text = str(caught.value)
    assert f"127.0.0.1:{port}" in text and "HTTP_PROXY" in text and "hunter2" not in text


def test_a_name_only_a_proxy_resolves_says_which_variable_routes_it(s3_shards, env) -> None:
    server, spec, _ = s3_shards
    options = _renamed_options(server, _renamed(server.endpoint_url))
    with pytest.raises(sd.StreamDataError) as caught:
        sd.TarDataset(spec, storage_options=options, fetch_config=sd.FetchConfig(retry_deadline=2))
    assert "HTTP_PROXY" in str(caught.value) and NAME in str(caught.value)


def test_https_through_an_authenticating_proxy(s3_shards, env) -> None:
    """The CONNECT carries Proxy-Authorization (our HTTP/1.1 client and the listing's)."""
    server, spec, keys = s3_shards
    with ForwardProxy({NAME: "127.0.0.1"}, auth=("alice", "s3cr3t-pw")) as guarded, \
            TLSFront(server.endpoint_url, names=[NAME]) as front:
        env.setenv("HTTPS_PROXY", guarded.url_with_auth)
        env.setenv("AWS_CA_BUNDLE", front.ca_file)
        options = _renamed_options(server, f"https://{NAME}:{front.port}")
        assert sorted(read_keys(sd.TarDataset(spec, storage_options=options, decode=False), 2)) == keys
        assert guarded.denied == 0 and sum(m == "CONNECT" for m, _ in guarded.requests) >= 2
        env.setenv("HTTPS_PROXY", guarded.url)
        with pytest.raises(sd.StreamDataError) as caught:
            sd.TarDataset(spec, storage_options=options, decode=False)
        assert "407" in str(caught.value) and "s3cr3t" not in str(caught.value)


def test_proxy_credentials_work_and_are_never_shown(s3_shards, env) -> None:
    server, spec, keys = s3_shards
    with ForwardProxy({NAME: "127.0.0.1"}, auth=("alice", "s3cr3t-pw")) as guarded:
        env.setenv("HTTP_PROXY", guarded.url_with_auth)
        options = _renamed_options(server, _renamed(server.endpoint_url))
        ds = sd.TarDataset(spec, storage_options=options, decode=False)
        assert sorted(read_keys(ds, 2)) == keys
        assert "s3cr3t" not in repr(ds) and "s3cr3t" not in str(ds.storage_options)
        env.setenv("HTTP_PROXY", guarded.url)  # no credentials: refused, at once
        started = time.monotonic()
        with pytest.raises(sd.StreamDataError) as caught:
            sd.TarDataset(spec, storage_options=options, decode=False)
        assert time.monotonic() - started < 10
        assert "407" in str(caught.value) and "user and password" in str(caught.value)


# ---- certificates ---------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [None, "auto"])
def test_an_untrusted_certificate_fails_at_once_with_what_to_do(s3_shards, env, index) -> None:
    server, spec, _ = s3_shards
    with TLSFront(server.endpoint_url) as front:
        options = _renamed_options(server, front.url)
        started = time.monotonic()
        with pytest.raises(ShardFetchError) as caught:
            sd.TarDataset(spec, storage_options=options, index=index)
        assert time.monotonic() - started < 10  # not retried to the deadline
    text = str(caught.value)
    assert "127.0.0.1" in text and "AWS_CA_BUNDLE" in text and "SSL_CERT_FILE" in text
    assert "streamdata.sdx" not in text  # the user never asked for the index file


@pytest.mark.parametrize("index", [None, "auto"])
def test_an_untrusted_certificate_on_https_urls(tmp_path, http_server, env, index) -> None:
    import fsspec

    write_shards(fsspec.filesystem("file"), str(tmp_path))
    server = http_server(tmp_path)
    with TLSFront(server.endpoint_url) as front:
        urls = [f"{front.url}/shard-{i:03d}.tar" for i in range(len(UNEVEN))]
        started = time.monotonic()
        with pytest.raises(ShardFetchError) as caught:
            list(sd.TarDataset(urls, index=index))
        assert time.monotonic() - started < 10
        text = str(caught.value)
        assert "not trusted" in text and "SSL_CERT_FILE" in text and "shard-000.tar" in text
        assert "streamdata.sdx" not in text
        env.setenv("SSL_CERT_FILE", front.ca_file)
        assert len(list(sd.TarDataset(urls, index=index, decode=False))) == sum(UNEVEN)


def test_verify_false_reads_and_warns(s3_shards, env) -> None:
    from streamdata.store import network

    server, spec, keys = s3_shards
    env.setattr(network, "_warned", set())
    with TLSFront(server.endpoint_url) as front:
        options = _renamed_options(server, front.url)
        options["client_kwargs"] = dict(options["client_kwargs"], verify=False)
        with pytest.warns(network.InsecureTLSWarning, match="not verified"):
            ds = sd.TarDataset(spec, storage_options=options, decode=False)
            assert sorted(read_keys(ds, 0)) == keys


# ---- writers and the command line ------------------------------------------------------------------


@pytest.mark.slow
def test_writer_and_cli_through_the_proxy(s3_bucket, proxy, env) -> None:
    import numpy as np

    server, bucket = s3_bucket
    env.setenv("HTTP_PROXY", proxy.url)
    options = _renamed_options(server, _renamed(server.endpoint_url))
    with sd.ShardWriter(f"s3://{bucket}/w/s-%03d.tar", maxcount=4, storage_options=options,
                        progress=False) as sink:
        for i in range(10):
            sink.write({"__key__": f"{i:04d}", "npy": np.full(4, i, np.float32)})
    assert any(method == "PUT" for method, _ in _through(proxy))
    ds = sd.TarDataset(f"s3://{bucket}/w/", storage_options=options, decode=False)
    assert sorted(s["__key__"] for s in ds) == [f"{i:04d}" for i in range(10)]
    cli_env = {**os.environ, "PYTHONPATH": str(REPO), "AWS_ACCESS_KEY_ID": server.key,
               "AWS_SECRET_ACCESS_KEY": server.secret, "AWS_DEFAULT_REGION": server.region,
               "AWS_ENDPOINT_URL": _renamed(server.endpoint_url)}
    before = len(proxy.requests)
    run = subprocess.run([sys.executable, "-m", "streamdata", "ls", f"s3://{bucket}/w/", "--json"],
                         capture_output=True, text=True, env=cli_env, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    listed = [shard["url"] for shard in json.loads(run.stdout)["shards"]]
    assert listed == [f"s3://{bucket}/w/s-{i:03d}.tar" for i in range(3)]
    assert len(proxy.requests) > before  # the CLI's listing went through the proxy
