"""The ``streamdata`` command against the S3 test server: every command's output, one-line
errors with exit code 2, help, storage options, progress bars and --quiet."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import streamdata as sd
from streamdata.cli import main
from streamdata.cli.common import UsageError, parse_storage_options
from streamdata.metrics import STAGES
from tests.helpers import write_shards

COMMANDS = ["demo", "ls", "inspect", "cat", "index", "convert", "bench"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, *words: str) -> None:
    assert code == 2, (code, out, err)
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("streamdata: error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


def _s3fs(server):
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)


@pytest.fixture
def bucket(s3_bucket):
    """Seven tar shards (27 samples) under d/, plus objects no TarDataset reads."""
    server, name = s3_bucket
    fs = _s3fs(server)
    keys = write_shards(fs, f"{name}/d")
    fs.pipe_file(f"{name}/d/meta.json", b"{}")
    fs.pipe_file(f"{name}/d/notes.txt", b"hello")
    return server, name, keys, ["-o", json.dumps(server.storage_options)]


# ---- storage options ------------------------------------------------------------------------


def test_storage_options_json_and_key_value_pairs():
    assert parse_storage_options(['{"anon": true, "x": 1}', "anon=false", "timeout=5", "name=abc",
                                  "client_kwargs.region_name=eu-west-1", "url=http://h:9000/x=1",
                                  "pad=0123"]) == {
        "anon": False, "x": 1, "timeout": 5, "name": "abc", "url": "http://h:9000/x=1",
        "client_kwargs": {"region_name": "eu-west-1"}, "pad": "0123"}
    for bad in ['{"anon": tru', "[1, 2]", "novalue", "=x", '{"a": 1}x']:
        with pytest.raises(UsageError, match="--storage-options"):
            parse_storage_options(["a=1", bad])


def test_key_value_options_reach_the_server(bucket, capsys):
    server, name, _, as_json = bucket
    pairs = ["-o", f"endpoint_url={server.endpoint_url}", "-o", f"key={server.key}",
             "-o", f"secret={server.secret}", "-o", f"client_kwargs.region_name={server.region}",
             "-o", "config_kwargs.s3.addressing_style=path"]
    code, by_pairs, _ = run_cli(capsys, "ls", f"s3://{name}/d/", *pairs)
    assert code == 0
    assert run_cli(capsys, "ls", f"s3://{name}/d/", *as_json)[1] == by_pairs


# ---- ls -----------------------------------------------------------------------------------


def test_ls_lists_exactly_what_the_dataset_reads(bucket, capsys):
    import gzip

    from tests.helpers import make_samples, tar_bytes

    server, name, _, opts = bucket
    spec = f"s3://{name}/d/"
    _s3fs(server).pipe_file(f"{name}/d/zipped.tar.gz", gzip.compress(tar_bytes(make_samples([2])[0])))
    expected = sd.TarDataset(spec, storage_options=server.storage_options).shards
    assert any(s.url.endswith("zipped.tar.gz") for s in expected) == (".tar.gz" in sd.TarDataset.suffixes)
    code, out, err = run_cli(capsys, "ls", spec, *opts)
    assert code == 0 and err == ""
    lines = out.strip().split("\n")
    assert [line.split()[1] for line in lines[:-1]] == [s.url for s in expected]
    assert [int(line.split()[0]) for line in lines[:-1]] == [s.size for s in expected]
    total = sum(s.size for s in expected)
    assert lines[-1] == f"{len(expected)} tar objects, {total} bytes ({total / 1e3:.1f} kB)"
    assert "meta.json" not in out and "notes.txt" not in out
    code, out, _ = run_cli(capsys, "ls", spec, "--json", "--limit", "2", *opts)
    listed = json.loads(out)
    assert listed["count"] == len(expected) and listed["total_bytes"] == total and listed["format"] == "tar"
    assert [s["url"] for s in listed["shards"]] == [s.url for s in expected]
    code, out, _ = run_cli(capsys, "ls", spec, "--limit", "2", *opts)
    assert out.count(f"s3://{name}/d/") == 2 and f"{len(expected) - 2} more" in out


def test_ls_auto_refuses_a_mixed_listing_and_format_picks(bucket, capsys):
    server, name, _, opts = bucket
    sd.write_parquet({"id": np.arange(10)}, f"s3://{name}/d/part.parquet",
                     storage_options=server.storage_options)
    assert_one_line_error(*run_cli(capsys, "ls", f"s3://{name}/d/", *opts), "1 parquet, 7 tar", "--format")
    code, out, _ = run_cli(capsys, "ls", f"s3://{name}/d/", "--format", "parquet", *opts)
    assert code == 0 and out.strip().split("\n")[-1].startswith("1 parquet object, ")
    assert out.count("s3://") == 1 and "part.parquet" in out


# ---- errors, help, quiet --------------------------------------------------------------------


@pytest.mark.parametrize("argv, words", [
    (["ls", "s3://b/x/", "-o", '{"anon": tru'], ["not valid JSON"]),
    (["ls", "s3://b/x/", "-o", "novalue"], ["key=value"]),
    (["ls", "--bogus", "s3://b/x/"], ["--bogus", "streamdata ls --help"]),
    (["frobnicate"], ["invalid choice"]),
    ([], ["required: COMMAND"]),
    (["ls", "s3://b/x-{1..2.tar"], ["braces"]),
    (["bench", "s3://b/x/", "--workers", "a,b"], ["comma-separated"]),
    (["cat", "/definitely/not/here/"], ["/definitely/not/here/"]),
])
def test_usage_errors_are_one_line_with_exit_code_2(capsys, argv, words):
    assert_one_line_error(*run_cli(capsys, *argv), *words)


def test_missing_bucket_is_one_line(s3_server, capsys):
    opts = ["-o", json.dumps(s3_server.storage_options)]
    for command in ("ls", "inspect", "cat", "bench"):
        assert_one_line_error(*run_cli(capsys, command, "s3://no-such-bucket-xyz/d/", *opts),
                              "no-such-bucket-xyz")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_renders_for_every_command(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    out, err = capsys.readouterr()
    assert info.value.code == 0 and err == ""
    assert out.startswith(f"usage: streamdata {command}")
    assert "``" not in out and ":class:" not in out and "%(" not in out
    if command != "demo":
        assert "--storage-options" in out and "--quiet" in out


def test_top_level_help_reads_as_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out
    for command in COMMANDS:
        assert f"\n    {command} " in out


def test_progress_bars_on_a_terminal_and_quiet_turns_them_off(bucket, capsys, monkeypatch, tmp_path):
    _, name, _, opts = bucket
    _image_folder(tmp_path / "imgs", per_class=2)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    runs = {"inspect": (["inspect", f"s3://{name}/d/"], ["listing", "reading"]),
            "cat": (["cat", f"s3://{name}/d/", "--key", "s000020"], ["searching"]),
            "index": (["index", f"s3://{name}/d/", "--output", f"s3://{name}/i/{{}}.sdx"],
                      ["indexing", "B/s"]),
            "convert": (["convert", str(tmp_path / "imgs"), f"s3://{name}/c{{}}/"],
                        ["convert imagefolder", "4/4"]),
            "bench": (["bench", f"s3://{name}/d/", "--workers", "0", "--seconds", "0.2"], ["bench", "1/1"])}
    for command, (argv, words) in runs.items():
        code, out, err = run_cli(capsys, *[a.format("loud") for a in argv], *opts)
        assert code == 0 and all(w in err for w in words), (command, err)
        code, quiet_out, err = run_cli(capsys, *[a.format("quiet") for a in argv], "--quiet", *opts)
        assert code == 0 and err == "", (command, err)
        if command in ("inspect", "cat"):
            assert quiet_out == out


def test_interrupt_exits_130_quietly_and_a_bug_is_one_line(capsys, monkeypatch):
    from streamdata.cli import listing

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(listing, "run", interrupted)
    assert run_cli(capsys, "ls", "x") == (130, "", "")

    def bug(args):
        raise TypeError("unsupported operand\nsecond line")

    monkeypatch.setattr(listing, "run", bug)
    code, out, err = run_cli(capsys, "ls", "x")
    assert code == 1 and out == "" and err == ("streamdata: error: unexpected TypeError: unsupported operand "
                                               "second line (--debug shows the traceback)\n")
    with pytest.raises(TypeError):
        main(["ls", "x", "--debug"])


# ---- inspect and cat ----------------------------------------------------------------------


def test_inspect_tar(bucket, capsys):
    _, name, keys, opts = bucket
    code, out, err = run_cli(capsys, "inspect", f"s3://{name}/d/", "--scan", "7", *opts)
    assert code == 0, err
    rows = dict(line.split(None, 1) for line in out.strip().split("\n") if not line.startswith("  "))
    assert rows["format"] == "tar" and rows["objects"].startswith("7, ")
    assert rows["samples"] in (f"{len(keys)} (counted)", f"{len(keys)} (from the index)")
    fields = {line.split()[0]: line.split(None, 2)[1:] for line in out.split("\n") if line.startswith("  ")}
    assert fields["npy"][0] == "160.0" and fields["npy"][1].startswith("ndarray float32 [8]")
    assert fields["cls"][0] == f"{sum(len(str(int(k[1:]))) for k in keys) / len(keys):.1f}"  # "7", "16"
    assert fields["cls"][1].startswith("int ")
    assert fields["json"][1].startswith("dict ")
    code, out, _ = run_cli(capsys, "inspect", f"s3://{name}/d/", *opts)  # one shard scanned
    assert "samples   about " in out or "(from the index)" in out


def test_inspect_parquet_counts_rows_from_the_footers(s3_bucket, capsys):
    server, name = s3_bucket
    table = {"id": np.arange(250), "emb": np.ones((250, 4), np.float32).tolist(),
             "text": [f"t{i}" for i in range(250)]}
    sd.write_parquet(table, f"s3://{name}/p/part-{{shard:03d}}.parquet", rows_per_shard=100,
                     row_group_size=50, storage_options=server.storage_options)
    code, out, err = run_cli(capsys, "inspect", f"s3://{name}/p/", "-o", json.dumps(server.storage_options))
    assert code == 0, err
    assert "objects   3, " in out and "samples   250 rows in 5 row groups (from the footers)" in out
    assert "Tensor int64 []" in out and "Tensor float64 [4]" in out and "str" in out
    sd.write_arrow({"id": np.arange(30)}, f"s3://{name}/a/part-{{shard:02d}}.arrow", rows_per_shard=20,
                   batch_size=10, storage_options=server.storage_options)
    code, out, err = run_cli(capsys, "inspect", f"s3://{name}/a/", "-o", json.dumps(server.storage_options))
    assert code == 0 and "format    arrow" in out, err
    assert "samples   30 rows in 3 record batches (from their headers)" in out
    code, out, err = run_cli(capsys, "cat", f"s3://{name}/a/", "--row", "25", "--field", "id",
                             "-o", json.dumps(server.storage_options))
    assert code == 0 and np.frombuffer(out.encode("latin-1"), np.int64).tolist() == [25], err


def test_cat_first_sample_by_key_and_raw_field(bucket, capsys):
    _, name, keys, opts = bucket
    code, out, _ = run_cli(capsys, "cat", f"s3://{name}/d/", *opts)
    assert code == 0 and out.split("\n")[0].split() == ["__key__", keys[0]]
    code, out, _ = run_cli(capsys, "cat", f"s3://{name}/d/", "--key", "s000016", *opts)
    lines = {line.split()[0]: line for line in out.strip().split("\n")}
    assert lines["__key__"].split()[1] == "s000016" and lines["__url__"].endswith("shard-003.tar")
    assert "ndarray float32 [8]  [16. 16. 16." in lines["npy"] and "int 16" in lines["cls"]
    code, out, _ = run_cli(capsys, "cat", f"s3://{name}/d/", "--row", "3", "--field", "json", *opts)
    assert code == 0 and json.loads(out) == {"n": 3}
    assert_one_line_error(*run_cli(capsys, "cat", f"s3://{name}/d/", "--key", "nope", *opts), "'nope'")
    assert_one_line_error(*run_cli(capsys, "cat", f"s3://{name}/d/", "--field", "png", *opts),
                          "no field 'png'", "cls, json, npy")


# ---- convert and bench --------------------------------------------------------------------


def _image_folder(root, classes=("cat", "dog"), per_class=5):
    from PIL import Image

    files = {}
    for c, cls in enumerate(classes):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            path = root / cls / f"img{i}.png"
            Image.fromarray(np.full((6, 4, 3), 10 * i + c, np.uint8)).save(path)
            files[path.read_bytes()] = c
    return files


def test_convert_image_folder_to_tar_shards_on_s3(s3_bucket, tmp_path, capsys):
    server, name = s3_bucket
    files = _image_folder(tmp_path / "imgs")
    opts = ["-o", json.dumps(server.storage_options)]
    code, out, err = run_cli(capsys, "convert", str(tmp_path / "imgs"), f"s3://{name}/out/",
                             "--maxcount", "4", "--workers", "3", "--shuffle", "1", *opts)
    assert code == 0, err
    assert out.startswith("wrote 10 samples (imagefolder, 2 classes") and "to 3 tar shards" in out
    ds = sd.TarDataset(f"s3://{name}/out/", storage_options=server.storage_options, decode=False)
    assert [s.url.rsplit("/", 1)[1] for s in ds.shards] == [f"shard-00000{i}.tar" for i in range(3)]
    samples = list(ds)
    assert sorted(s["__key__"] for s in samples) == [f"{i:09d}" for i in range(10)]
    assert {s["png"]: int(s["cls"]) for s in samples} == files
    assert _s3fs(server).cat_file(f"{name}/out/classes.txt") == b"cat\ndog\n"


def test_convert_jsonl_to_parquet_and_tar(s3_bucket, tmp_path, capsys):
    server, name = s3_bucket
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps({"text": f"line {i}", "n": i}) + "\n" for i in range(25)) + "\n")
    opts = ["-o", json.dumps(server.storage_options)]
    code, out, err = run_cli(capsys, "convert", str(src), f"s3://{name}/pq/train-%03d.parquet",
                             "--format", "parquet", "--maxcount", "10", *opts)
    assert code == 0 and "to 3 parquet shards" in out, err
    ds = sd.ParquetDataset(f"s3://{name}/pq/", storage_options=server.storage_options, batch_size=25)
    assert [s.url.rsplit("/", 1)[1] for s in ds.shards] == ["train-000.parquet", "train-001.parquet",
                                                            "train-002.parquet"]
    (batch,) = list(ds)
    assert batch["n"].tolist() == list(range(25)) and batch["text"][3] == "line 3"
    code, out, err = run_cli(capsys, "convert", str(src), f"s3://{name}/tar/", *opts)
    assert code == 0, err
    samples = list(sd.TarDataset(f"s3://{name}/tar/", storage_options=server.storage_options))
    assert [s["json"]["n"] for s in samples] == list(range(25))
    code, out, err = run_cli(capsys, "convert", str(src), f"s3://{name}/zst/", "--compress", "zst",
                             "--maxcount", "20", *opts)
    assert code == 0 and "index     none: compressed" in out, err
    ds = sd.TarDataset(f"s3://{name}/zst/", storage_options=server.storage_options)
    assert [s.url.rsplit("/", 1)[1] for s in ds.shards] == ["shard-000000.tar.zst", "shard-000001.tar.zst"]
    assert [s["json"]["n"] for s in ds] == list(range(25))
    assert_one_line_error(*run_cli(capsys, "convert", str(src), f"s3://{name}/x/", "--compress", "gz",
                                   "--format", "parquet", *opts), "--compress is for tar")


def test_convert_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{"a": \n')
    assert_one_line_error(*run_cli(capsys, "convert", str(tmp_path / "bad.jsonl"), str(tmp_path / "o")),
                          "line 2 is not JSON")
    assert_one_line_error(*run_cli(capsys, "convert", str(tmp_path / "nothing"), str(tmp_path / "o")),
                          "no such file or directory")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(*run_cli(capsys, "convert", str(tmp_path / "empty"), str(tmp_path / "o")),
                          "no images")
    _image_folder(tmp_path / "imgs", classes=("a", "b"), per_class=1)
    (tmp_path / "imgs" / "c").mkdir()  # torchvision would number it 2, and refuses it
    assert_one_line_error(*run_cli(capsys, "convert", str(tmp_path / "imgs"), str(tmp_path / "o")),
                          "class directory 'c' holds no images")
    (tmp_path / "imgs" / "c" / "notes.txt").write_text("x")
    (tmp_path / "imgs" / "c" / "x.jpg").write_bytes((tmp_path / "imgs" / "a" / "img0.png").read_bytes())
    (tmp_path / "imgs" / "b" / "labels.csv").write_text("x")
    code, out, err = run_cli(capsys, "convert", str(tmp_path / "imgs"), str(tmp_path / "o"))
    assert code == 0 and "wrote 3 samples (imagefolder, 3 classes" in out, err
    assert ("skipped   2 files that are not images or media (.jpg, .mp4, ...): b/labels.csv, c/notes.txt"
            in out)
    assert (tmp_path / "o" / "classes.txt").read_text() == "a\nb\nc\n"


@pytest.mark.slow
def test_bench_prints_rates_per_setting_and_writes_a_png(bucket, tmp_path, capsys):
    _, name, keys, opts = bucket
    png = tmp_path / "bench.png"
    code, out, err = run_cli(capsys, "bench", f"s3://{name}/d/", "--workers", "0,1", "--window", "2,8",
                             "--seconds", "0.5", "--batch-size", "4", "--png", str(png), *opts)
    assert code == 0, err
    lines = out.strip().split("\n")
    table = lines.index(next(line for line in lines if line.startswith("stage seconds")))
    rows = [line.split() for line in lines[2:table]]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(0, 2), (1, 2), (0, 8), (1, 8)]
    for r in rows:  # (how many samples fit in 0.5 s depends on the machine: only > 0 is checked)
        assert int(r[2]) > 0 and float(r[4]) > 0 and float(r[5]) > 0 and float(r[6]) > 0
    assert lines[table + 1].split() == ["workers", "window", "stall", *STAGES]
    stages = [line.split() for line in lines[table + 2:-1]]  # the stage table, then the chart's line
    assert [(int(r[0]), int(r[1])) for r in stages] == [(0, 2), (1, 2), (0, 8), (1, 8)]
    for r in stages:  # every setting parsed its samples: a reader's parse time is never 0
        assert 0 <= float(r[2].rstrip("%")) <= 100 and float(r[3 + STAGES.index("parse")]) > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the entry point, as a user runs it -------------------------------------------------------


def _subprocess(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamdata", *argv], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow
def test_entry_point_runs_and_never_prints_a_traceback(bucket):
    _, name, keys, opts = bucket
    done = _subprocess("cat", f"s3://{name}/d/", "--field", "cls", *opts)
    assert done.returncode == 0 and done.stdout == "0" and done.stderr == ""
    done = _subprocess("inspect", f"s3://{name}-missing/d/", *opts)
    assert_one_line_error(done.returncode, done.stdout, done.stderr, f"{name}-missing")


# ---- index --------------------------------------------------------------------------------


def test_index_builds_what_inspect_and_the_index_read(bucket, capsys):
    from streamdata.catalog.index import read_index

    server, name, keys, opts = bucket
    spec = f"s3://{name}/d/"
    code, out, _ = run_cli(capsys, "inspect", spec, *opts)
    assert "index     none at " in out and "samples   about " in out
    code, out, err = run_cli(capsys, "index", spec, *opts)
    assert code == 0, err
    url = f"s3://{name}/d/_streamdata.sdx"
    assert out.strip() == f"wrote {url}: 7 shards, {len(keys)} samples (offsets {8 * (len(keys) + 7)} B)"
    entries = read_index(url, server.storage_options)
    assert sorted(e.name for e in entries) == [f"shard-{i:03d}.tar" for i in range(7)]
    assert read_index(f"s3://{name}/d/streamdata.sdx", server.storage_options) is None  # old name: unwritten
    code, out, _ = run_cli(capsys, "inspect", spec, *opts)
    assert f"samples   {len(keys)} (from the index)" in out
    assert f"index     {url}: 7/7 shards, {len(keys)} samples" in out
    code, out, _ = run_cli(capsys, "ls", spec, *opts)
    assert "streamdata.sdx" not in out  # the index (either name) is not a shard
    from tests.helpers import make_samples, tar_bytes

    _s3fs(server).pipe_file(f"{name}/d/shard-000.tar", tar_bytes(make_samples([2])[0]))  # was 5 samples
    code, out, _ = run_cli(capsys, "inspect", spec, "--scan", "7", *opts)
    assert f"samples   {len(keys) - 3} (counted)" in out  # not the stale index's count
    assert f"7/7 shards, {len(keys)} samples, 1 stale, 0 missing: run `streamdata index SPEC`" in out
    other = f"s3://{name}/elsewhere/all.sdx"
    code, out, err = run_cli(capsys, "index", spec, "--output", other, "--quiet", *opts)
    assert code == 0 and out.startswith(f"wrote {other}: 7 shards") and err == ""


def test_convert_writes_the_index_of_its_tar_shards(s3_bucket, tmp_path, capsys):
    from streamdata.catalog.index import lookup
    from streamdata.formats.tar import samples_from_chunks

    server, name = s3_bucket
    _image_folder(tmp_path / "imgs", per_class=3)
    code, out, err = run_cli(capsys, "convert", str(tmp_path / "imgs"), f"s3://{name}/o/train-%04d.tar",
                             "--maxcount", "4", "-o", json.dumps(server.storage_options))
    assert code == 0, err
    assert f"index     s3://{name}/o/_streamdata.sdx" in out
    ds = sd.TarDataset(f"s3://{name}/o/", storage_options=server.storage_options, decode=False)
    found = lookup(ds.shards, "auto", server.storage_options)
    assert found is not None and found.counts.tolist() == [4, 2]
    fs = _s3fs(server)
    for shard, offsets in zip(ds.shards, found.offsets, strict=True):  # each range holds its sample
        data = fs.cat_file(shard.url[len("s3://"):])
        assert offsets[-1] < len(data) and data[offsets[-1]:offsets[-1] + 1024] == bytes(1024)
        keys = []
        for a, b in zip(offsets[:-1], offsets[1:], strict=True):  # [a, b) + an end marker: one sample
            keys += [s["__key__"] for s in samples_from_chunks([data[int(a):int(b)] + bytes(1024)])]
        assert keys == [s["__key__"] for s in samples_from_chunks([data]) if s["__url__"] is not None]


@pytest.mark.slow  # three interpreters that import torch: ~30 s on a busy 2-core machine
def test_credentials_and_endpoint_from_the_environment(bucket, tmp_path):
    """fsspec (botocore) reads AWS_* variables; the command adds nothing and takes nothing away."""
    import os

    server, name, _, _ = bucket
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    creds = {"AWS_ACCESS_KEY_ID": server.key, "AWS_SECRET_ACCESS_KEY": server.secret}

    def ls(extra: dict, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "streamdata", "ls", f"s3://{name}/d/", *argv],
                              env={**env, **extra}, capture_output=True, text=True, timeout=120)

    done = ls({}, "-o", f"endpoint_url={server.endpoint_url}")
    assert_one_line_error(done.returncode, done.stdout, done.stderr, "access denied", "credentials")
    done = ls(creds, "-o", f"endpoint_url={server.endpoint_url}")
    assert done.returncode == 0 and done.stdout.endswith("7 tar objects, 215040 bytes (215.0 kB)\n")
    done = ls({**creds, "AWS_ENDPOINT_URL": server.endpoint_url, "AWS_DEFAULT_REGION": server.region})
    assert done.returncode == 0 and "7 tar objects" in done.stdout, done.stderr


def test_timeout_bounds_a_listing_of_an_unreachable_endpoint(capsys, monkeypatch):
    from streamdata.testing import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, out, err = run_cli(capsys, "ls", "s3://bkt/x/", "-o", f"endpoint_url={endpoint}",
                             "-o", "key=x", "-o", "secret=y", "--timeout", "0.5")
    assert_one_line_error(code, out, err, "cannot list s3://bkt/x/", "attempts in")
    import re

    assert float(re.search(r"attempts in ([0-9.]+) s", err).group(1)) < 5  # not the default 120 s
    assert_one_line_error(*run_cli(capsys, "ls", "s3://bkt/x/", "--timeout", "0"), "--timeout must be > 0")
