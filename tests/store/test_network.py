"""PROXY-ROUTE and TRUST (streamdata/store/network.py): which proxy a URL goes through, which
certificates verify it, and what the messages say; no server needed here (the end-to-end
runs through a real proxy and TLS front are in tests/test_networks.py)."""

from __future__ import annotations

import ssl
import warnings

import pytest

from streamdata.errors import SpecError
from streamdata.store import network
from streamdata.store.network import Network, Proxy, bypassed

_VARS = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY",
         "no_proxy", "NO_PROXY", "AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("host", "port", "no_proxy", "expected"), [
    ("bucket.corp.test", 80, "corp.test", True),  # a domain covers its sub-domains
    ("bucket.corp.test", 80, ".corp.test", True),
    ("corp.test", 80, ".corp.test", True),
    ("notcorp.test", 80, "corp.test", False),  # a suffix, not a substring
    ("bucket.corp.test", 9000, "bucket.corp.test:9000", True),
    ("bucket.corp.test", 9001, "bucket.corp.test:9000", False),  # another port
    ("10.1.2.3", 80, "10.0.0.0/8", True),
    ("11.1.2.3", 80, "10.0.0.0/8", False),
    ("127.0.0.1", 5000, "localhost, 127.0.0.1", True),
    ("::1", 80, "[::1]:80", True),
    ("anything.example", 443, "*", True),
    ("anything.example", 443, "", False),
    ("Bucket.Corp.Test.", 80, "CORP.test", True),  # case and a trailing dot do not matter
])
def test_no_proxy_matching(host, port, no_proxy, expected) -> None:
    assert bypassed(host, port, no_proxy) is expected


def test_environment_proxies_lower_case_first_all_proxy_last(monkeypatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://upper:3128")
    monkeypatch.setenv("https_proxy", "http://lower:3128")
    monkeypatch.setenv("ALL_PROXY", "http://every:8080")
    net = Network()
    assert net.proxy("https://bucket.s3.amazonaws.com/k").host == "lower"
    assert net.proxy("https://bucket.s3.amazonaws.com/k").source == "https_proxy"
    assert net.proxy("http://plain.example/k").host == "every"  # no HTTP_PROXY: ALL_PROXY
    monkeypatch.setenv("NO_PROXY", "s3.amazonaws.com")
    net = Network()
    assert net.proxy("https://bucket.s3.amazonaws.com/k") is None
    assert net.proxy("https://other.example/k").host == "lower"
    assert net.proxied


def test_storage_options_proxies_win_over_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://env:3128")
    net = Network({"config_kwargs": {"proxies": {"https": "http://opt:8888", "no_proxy": "internal"}}})
    assert net.proxy("https://bucket.example/k").host == "opt"
    assert net.proxy("https://bucket.example/k").port == 8888
    assert net.proxy("https://a.internal/k") is None
    assert net.proxy("http://bucket.example/k") is None  # options name no http proxy: direct
    one_host = Network({"proxies": {"https://special.example": "http://only:1", "all": "http://rest:2"}})
    assert one_host.proxy("https://special.example/k").host == "only"
    assert one_host.proxy("https://other.example/k").host == "rest"


def test_proxy_credentials_are_a_header_and_never_shown() -> None:
    proxy = Proxy.parse("http://alice:s%40cret@proxy.corp:3128", "HTTPS_PROXY")
    assert proxy.authorization == "Basic YWxpY2U6c0BjcmV0"  # base64 of alice:s@cret
    assert proxy.basic_credentials() == "alice:s@cret"
    for text in (repr(proxy), proxy.shown, repr(Network({"proxies": {"all": "http://alice:s%40cret@p:1"}}))):
        assert "cret" not in text and "YWxp" not in text
    assert proxy.shown == "http://alice:***@proxy.corp:3128"


@pytest.mark.parametrize("url", ["https://proxy:3128", "socks5://proxy:1080", "http://:3128"])
def test_unsupported_proxy_urls_are_refused_clearly(url) -> None:
    with pytest.raises(SpecError, match="proxy"):
        Proxy.parse(url, "HTTPS_PROXY")


def test_a_bare_host_port_is_an_http_proxy() -> None:
    proxy = Proxy.parse("proxy.corp:3128", "HTTP_PROXY")
    assert (proxy.host, proxy.port, proxy.authorization) == ("proxy.corp", 3128, None)


def test_trust_order(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/requests/ca.pem")
    assert Network(protocol="https").bundle == "/requests/ca.pem"
    monkeypatch.setenv("AWS_CA_BUNDLE", "/aws/ca.pem")
    assert Network(protocol="s3").bundle == "/aws/ca.pem"  # botocore's variable, for S3
    assert Network(protocol="https").bundle == "/requests/ca.pem"  # not for other hosts
    given = Network({"client_kwargs": {"verify": "/opt/ca.pem"}}, protocol="s3")
    assert (given.bundle, given.bundle_source) == ("/opt/ca.pem", "storage_options verify")
    monkeypatch.delenv("AWS_CA_BUNDLE")
    monkeypatch.delenv("REQUESTS_CA_BUNDLE")
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
    net = Network(protocol="s3")
    assert (net.bundle, net.bundle_source) == (str(tmp_path / "ca.pem"), "SSL_CERT_FILE")


def test_an_unreadable_bundle_is_a_spec_error_naming_it(tmp_path) -> None:
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    with pytest.raises(SpecError, match="ca.pem"):
        Network({"verify": str(bad)}).ssl_context("https://h/")


def test_verify_false_does_not_verify_and_warns_once(monkeypatch) -> None:
    monkeypatch.setattr(network, "_warned", set())
    net = Network({"client_kwargs": {"verify": False}})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ctx = net.ssl_context("https://a.example/")
        net.ssl_context("https://b.example/")
        Network({"verify": False}).ssl_context("https://c.example/")
    assert ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname
    assert [type(w.message) for w in seen] == [network.InsecureTLSWarning]
    assert "a.example" in str(seen[0].message)
    assert Network().ssl_context("https://a.example/").verify_mode == ssl.CERT_REQUIRED


def test_hints_name_the_host_and_the_variables(monkeypatch) -> None:
    hint = network.certificate_hint("bucket.corp.test", Network())
    for word in ("bucket.corp.test", "AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "verify"):
        assert word in hint
    url = "https://bucket.corp.test/"
    assert "HTTPS_PROXY" in network.resolution_hint("bucket.corp.test", url, Network())
    monkeypatch.setenv("HTTPS_PROXY", "http://u:pw@proxy:1")
    monkeypatch.setenv("NO_PROXY", "corp.test")
    text = network.resolution_hint("bucket.corp.test", "https://bucket.corp.test/", Network())
    assert "NO_PROXY" in text and "pw" not in text
    monkeypatch.delenv("NO_PROXY")
    text = network.resolution_hint("bucket.corp.test", "https://bucket.corp.test/", Network())
    assert "proxy http://u:***@proxy:1" in text and "HTTPS_PROXY" in text
