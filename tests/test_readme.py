"""The README's quick-start block runs as written, against a local S3 server on the port it names."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import make_samples, tar_bytes

README = Path(__file__).resolve().parent.parent / "README.md"


def _quick_start() -> str:
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quick_start_runs(s3_server):
    import s3fs

    code = _quick_start()
    endpoint = re.search(r'"endpoint_url": "([^"]+)"', code).group(1)
    s3_server.create_bucket("bkt")
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    shards = make_samples([4] * 32)
    for i, samples in enumerate(shards):
        fs.pipe_file(f"bkt/train-{i:06d}.tar", tar_bytes(samples))
    # the README names the endpoint of a MinIO on :9000; point that string at the test server,
    # add the test server's credentials, and record what the loop body sees
    code = code.replace(endpoint, s3_server.endpoint_url)
    code = code.replace('storage_options={', 'storage_options={**CREDS, ')
    code = code.replace("    ...", "    SEEN.append(batch)")
    seen: list = []
    creds = {k: v for k, v in s3_server.storage_options.items() if k != "endpoint_url"}
    exec(compile(code, str(README), "exec"), {"CREDS": creds, "SEEN": seen})
    keys = [k for b in seen for k in b["__key__"]]
    assert sorted(keys) == sorted(s["__key__"] for shard in shards for s in shard)
    assert all(set(b) >= {"__key__", "npy", "cls"} for b in seen)
    assert tuple(seen[0]["npy"].shape) == (32, 8)
