"""``loader.metrics()`` for Prometheus: a collector, and an HTTP endpoint that serves it.

``serve_prometheus(loader, port=...)`` starts ``prometheus_client``'s HTTP server (a daemon
thread) on a registry of its own, holding one collector: each scrape calls ``metrics()`` on the
loader (``sd.loader``'s ``Loader`` or ``sd.timed``'s wrapper) and exposes every number in it as
a gauge named ``streamdata_<key>`` (``stage.wait_bytes_s`` -> ``streamdata_stage_wait_bytes_s``),
with the given ``labels`` (a rank, a job) on each. Strings (the verdict) and Nones are left out.
``prometheus_client`` is optional (``pip install streamdata[prometheus]``): imported here, on
the first call, never by ``import streamdata``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from streamdata.errors import BackendMissingError, SpecError

__all__ = ["PrometheusServer", "collector", "metric_name", "serve_prometheus"]

_BAD = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(key: str) -> str:
    """The gauge a ``metrics()`` key is exposed as."""
    return "streamdata_" + _BAD.sub("_", key)


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise BackendMissingError("Prometheus exposition needs prometheus_client: "
                                  "pip install 'streamdata[prometheus]' (or prometheus-client)") from exc
    return prometheus_client


def collector(loader: Any, labels: Mapping[str, str] | None = None) -> Any:
    """A ``prometheus_client`` collector of ``loader.metrics()``'s numbers, read at each scrape."""
    from prometheus_client.core import GaugeMetricFamily

    _client()
    names, values = list((labels or {}).keys()), [str(v) for v in (labels or {}).values()]

    class LoaderCollector:
        def collect(self) -> Iterator[Any]:
            for key, value in loader.metrics().items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                gauge = GaugeMetricFamily(metric_name(key), f"streamdata loader.metrics()['{key}']",
                                          labels=names)
                gauge.add_metric(values, float(value))
                yield gauge

    return LoaderCollector()


class PrometheusServer:
    """The running endpoint: ``url``, ``port``; ``close()`` stops it."""

    def __init__(self, server: Any, thread: Any, registry: Any) -> None:
        self._server, self._thread, self.registry = server, thread, registry
        self.host, self.port = server.server_address[:2]
        self.url = f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_prometheus(loader: Any, port: int = 0, addr: str = "127.0.0.1",
                     labels: Mapping[str, str] | None = None) -> PrometheusServer:
    """Serve ``loader.metrics()`` at ``http://addr:port/metrics`` (``port=0``: any free port,
    see ``.port``) for Prometheus to scrape, until ``.close()``."""
    client = _client()
    if not callable(getattr(loader, "metrics", None)):
        raise SpecError("serve_prometheus() takes sd.loader(...) or sd.timed(...) (something with "
                        f".metrics()), got {type(loader).__name__}")
    registry = client.CollectorRegistry()
    registry.register(collector(loader, labels))
    server, thread = client.start_http_server(port, addr=addr, registry=registry)
    return PrometheusServer(server, thread, registry)
