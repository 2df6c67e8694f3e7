"""The public surface: __all__ complete and sorted, import stays light, README example runs."""

import subprocess
import sys

import streamdata


def test_all_is_sorted_and_complete():
    public = {n for n in dir(streamdata) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(streamdata, n)).__name__ == "module"}
    assert streamdata.__all__ == sorted(streamdata.__all__)
    assert set(streamdata.__all__) == public - modules


def test_import_does_not_load_backends():
    code = ("import sys, streamdata; heavy = [m for m in ('s3fs', 'gcsfs', 'pyarrow', 'aiohttp', 'moto') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
