"""Slow: the benchmark scripts still run end to end and read every sample (numbers not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_latency_benchmark_quick_reads_every_sample(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.latency", "--quick", "--methods", "wire,streamdata,webdataset",
           "--rounds", "2", "--sweep-workers", "", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [result] = tmp_path.glob("latency-*.json")
    rows = json.loads(result.read_text())["results"]
    by_method = {(r["method"], r["delay_ms"]): r for r in rows}
    for (method, delay), row in by_method.items():
        assert "error" not in row, (method, delay, row.get("error"))
        assert len(row["rounds"]) == 2 and row["reps"] == 2  # two rounds of one repetition
    sd_rows = [r for (m, _), r in by_method.items() if m == "streamdata"]
    assert sd_rows and all(r["samples"] == 512 for r in sd_rows)
    assert "Per round (2 rounds, methods interleaved)" in done.stdout



def test_token_shuffle_benchmark_quick(tmp_path):
    out = tmp_path / "token_shuffle.json"
    cmd = [sys.executable, "-m", "benchmarks.token_shuffle", "--quick", "--delays", "0", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [row] = json.loads(out.read_text())["results"]
    assert row["sequential"]["tokens"] == row["sequences"]["tokens"] > 0
    assert row["sequences"]["bytes_per_token"] == row["sequential"]["bytes_per_token"]

def test_latency_benchmark_rss_mode(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.latency", "--rss", "--rss-sizes", "1,16", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [result] = tmp_path.glob("rss-*.json")
    rows = json.loads(result.read_text())["rss"]
    assert [r["shard_mb"] for r in rows] == [1, 16]


def test_epochs_benchmark_compares_both_settings(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.epochs", "--epochs", "3", "--rounds", "1", "--samples", "256",
           "--shards", "4", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [result] = tmp_path.glob("epochs-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert set(rows) == {"reuse", "glibc defaults"}
    for epochs in rows.values():
        assert [r["epoch"] for r in epochs] == [1, 2] and all(r["samples"] == 256 for r in epochs)
    assert "reuse / glibc defaults" in done.stdout


def test_startup_benchmark_times_every_stage(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.startup", "--samples", "128", "--shards", "4",
           "--rounds", "1", "--delays", "0", "--epochs", "2", "--methods", "wire,streamdata,webdataset",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [result] = tmp_path.glob("startup-*.json")
    rows = {r["method"]: r for r in json.loads(result.read_text())["rows"]}
    assert set(rows) == {"wire", "streamdata", "webdataset"} and not any("error" in r for r in rows.values())
    sd_row = rows["streamdata"]
    # the one listing and the index="auto" lookup (one GET, sent with the listing: INDEX-AHEAD; a 404 here)
    assert sd_row["samples"] == 128 and sd_row["ctor_request_kinds"] == "GET GET"
    stages = ("import", "ctor_imports", "listing", "worker_start", "worker_setup", "first_byte",
              "first_batch")
    assert abs(sum(sd_row[s] for s in stages) - sd_row["first_batch_s"]) < 1e-6
    assert all(sd_row[s] == sd_row[s] for s in stages) and sd_row["epoch2_from_iter_s"] > 0  # no NaN


def test_index_build_benchmark_counts_every_sample():
    cmd = [sys.executable, "-m", "benchmarks.index_build", "--quick", "--rounds", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "round 1: index" in done.stdout and "median of 1 rounds" in done.stdout


def test_metrics_overhead_pairs_count_the_clock_reads_the_timings_add(tmp_path):
    """benchmarks/metrics_overhead.py --pairs: paired passes in one interpreter, and the clock's
    reads per sample counted each way (a reader's stages read it three times a record; off, only
    the training loop's side reads it, twice a batch of 32, and a part the reader waits for,
    twice: more often on a loaded machine)."""
    out = tmp_path / "overhead.json"
    cmd = [sys.executable, "-m", "benchmarks.metrics_overhead", "--pairs", "2", "--samples", "640",
           "--shards", "2", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(out.read_text())
    summary = got["summary"]
    assert len(got["pairs"]) == 2 and all(p["samples"] == 640 for p in got["pairs"])
    on, off = summary["clock_reads_per_sample_on"], summary["clock_reads_per_sample_off"]
    assert 2 / 32 <= off < 0.25 and 2.5 < on - off < 4  # three a record
    assert 0 < summary["ns_per_read_and_sum"] < 10_000 and summary["clock_share_of_a_sample"] > 0
    assert all(0 < ns < 100_000 for ns in summary["each_ns_on_off"] + summary["samples_ns_on_off"])


def test_plan_benchmark_runs_small(capsys):
    from benchmarks import plan

    plan.main(["--shards", "1000", "--ranks", "16", "--workers", "2", "--readers", "3"])
    out = capsys.readouterr().out
    assert out.count("median") == 4 and "1,000 shards" in out


@pytest.mark.parametrize("what", ["decode", "upload"])
def test_compressed_benchmark_runs(what):
    cmd = [sys.executable, "-m", "benchmarks.compressed", what, "--rounds", "1", "--samples", "64",
           "--shards", "4", "--sample-kb", "16"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert ("x plain" if what == "decode" else "ShardWriter / serial put") in done.stdout


def test_lite_http_benchmark_compares_both_clients():
    """benchmarks/lite_http.py: both children read every byte; the h1 one without aiohttp
    (the script asserts it per round)."""
    cmd = [sys.executable, "-m", "benchmarks.lite_http", "--rounds", "1", "--shards", "2",
           "--shard-mib", "2", "--part-mib", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| CPU per MB |" in done.stdout and "[1/1] h1:" in done.stdout


def test_gpu_feed_benchmark_without_cuda_says_so_and_exits_0():
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA the benchmark runs for real: benchmarks/gpu_check.sh")
    done = subprocess.run([sys.executable, "benchmarks/gpu_feed.py", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no CUDA device" in done.stdout


def test_images_benchmark_reads_every_image(tmp_path):
    out = tmp_path / "images.json"
    cmd = [sys.executable, "-m", "benchmarks.images", "--quick", "--images", "192", "--per-shard", "64",
           "--methods", "streamdata,streamdata-1x2,webdataset,litdata,mosaic", "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert set(runs) == {"streamdata@0", "streamdata-1x2@0", "webdataset@0"}
    for method, [run] in runs.items():
        assert "error" not in run, (method, run)
        assert run["images"] == 192 and run["batch_shape"][1:] == [3, 224, 224]
    assert "x peer img/s" in done.stdout
    for peer in ("litdata", "mosaic"):  # without --peers-python: reported, not run
        assert f"{peer}: not measured: no --peers-python given" in done.stdout


def test_autotune_benchmark_finds_when_a_run_reached_a_rate():
    from benchmarks.autotune import reached

    # 100 samples: 10 a second for the first 20, then 100 a second
    marks = [[i / 10, i] for i in range(1, 21)] + [[2 + (i - 20) / 100, i] for i in range(21, 101)]
    assert reached(marks, 100, 90.0, 0.1) == 0.2  # from sample 20 on, ten samples take 0.1 s
    assert reached(marks, 100, 5.0, 0.1) == 0.0
    assert reached(marks, 100, 1000.0, 0.1) is None


@pytest.mark.slow
def test_switch_off_pairs_each_mechanism_with_the_runs_beside_it(tmp_path):
    """benchmarks/switch_off.py --quick: one round, each mechanism off between two runs with it on,
    every run reading every sample, the table's ratios from those pairs."""
    out = tmp_path / "switch_off.json"
    cmd = [sys.executable, "-m", "benchmarks.switch_off", "--quick", "--delays", "0", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rounds"]
    assert [row["off"] for row in rows][::2] == ["ON"] * 3  # each OFF between two ONs
    assert sorted(row["off"] for row in rows[1::2]) == ["INHERITED-HEAP", "LITE-HTTP"]
    assert len({row["samples"] for row in rows}) == 1
    assert "| LITE-HTTP | 0 ms |" in done.stdout and "| INHERITED-HEAP | 0 ms |" in done.stdout


def test_media_benchmark_quick_compares_clip_and_whole_and_ranged_reads():
    cmd = [sys.executable, "-m", "benchmarks.media", "--quick", "--delays", "0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "clip / whole: clips/s x" in done.stdout
    # the standalone object: read ahead, one request at a time, and whole, side by side
    assert "ahead / serial: time x" in done.stdout and "ahead / whole: time x" in done.stdout
