"""sd.serve_prometheus: loader.metrics() scraped over HTTP for real, parsed as Prometheus text."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import fsspec
import pytest

import streamdata as sd
from streamdata.integrations.prometheus import metric_name
from tests.helpers import doc_blocks, write_shards

prometheus_client = pytest.importorskip("prometheus_client")


def _scrape(url: str) -> dict[str, tuple[dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    return {s.name: (s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples}


def test_a_scrape_serves_the_loaders_numbers(tmp_path: Path):
    (tmp_path / "shards").mkdir()
    write_shards(fsspec.filesystem("file"), str(tmp_path / "shards"), counts=[16] * 2, floats=8)
    ds = sd.TarDataset(f"file://{tmp_path}/shards/shard-{{000..001}}.tar", index=None)
    loader = sd.loader(ds, batch_size=4, num_workers=0)
    with sd.serve_prometheus(loader, labels={"rank": "0"}) as server:
        before = _scrape(server.url)
        assert before["streamdata_steps"] == ({"rank": "0"}, 0.0)
        steps = sum(1 for _ in loader)
        got = _scrape(server.url)
        m = loader.metrics()
        assert got["streamdata_steps"] == ({"rank": "0"}, float(steps)) and steps == 8
        assert got[metric_name("stage.parse_s")][1] > 0
        assert got["streamdata_samples"][1] == m["samples"] == 32
        assert all(metric_name(k) in got for k, v in m.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool))
        assert "streamdata_verdict" not in got  # strings are left out
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=2)
    loader.close()


def test_only_loaders_are_served():
    with pytest.raises(sd.SpecError, match="serve_prometheus"):
        sd.serve_prometheus(object())
    assert metric_name("stage.wait_bytes_s") == "streamdata_stage_wait_bytes_s"


def test_the_docs_recipe_serves_while_it_trains(tmp_path: Path):
    """docs/metrics.md's Prometheus block, for real (a free port, no workers): scraped mid-run."""

    (code,) = doc_blocks("docs/metrics.md", "### Prometheus")
    code = code.replace("port=9400", "port=0").replace("num_workers=4", "num_workers=0")
    (tmp_path / "shards").mkdir()
    write_shards(fsspec.filesystem("file"), str(tmp_path / "shards"), counts=[40] * 4, floats=8)
    scraped: list = []

    def train_step(batch):
        scraped.append(_scrape(ns["server"].url)["streamdata_steps"])

    ns: dict = {"sd": sd, "train_step": train_step,
                "ds": sd.TarDataset(f"file://{tmp_path}/shards/shard-{{000..003}}.tar", index=None)}
    exec(compile(code, "docs/metrics.md", "exec"), ns)
    ns["loader"].close()
    assert scraped == [({"rank": "0"}, float(step)) for step in (1, 2, 3)]  # 160 samples, 64 a batch
