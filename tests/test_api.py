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


# every name the package exported before its modules moved into layer folders
_PUBLIC_BEFORE_THE_MOVE = [
    "AccessDeniedError", "ArrowDataset", "BackendMissingError", "CudaPrefetcher", "DecodeError",
    "FetchConfig", "FetchItem", "FetchTimeoutError", "FormatError", "Loader", "Mix", "ObjectDataset",
    "ParquetDataset", "PinAhead", "Prefetcher", "Shard", "ShardFetchError", "ShardNotFoundError",
    "ShardWriter", "ShardedDataset", "SharedMemoryError", "SpecError", "StaleIndexError",
    "StreamDataError", "TarDataset", "World", "build_index", "expand_spec", "loader", "pin_batch",
    "write_arrow", "write_parquet",
]


def test_the_public_names_import_as_before_and_merge_states_joins_them():
    for name in _PUBLIC_BEFORE_THE_MOVE + ["merge_states"]:
        assert name in streamdata.__all__, name
        assert getattr(streamdata, name) is not None, name
    namespace: dict = {}
    exec("from streamdata import *", namespace)  # noqa: S102 - the star import users write
    assert set(streamdata.__all__) <= set(namespace)
    head = {"format": "f", "version": 1, "fingerprint": "x", "split": "samples", "epoch": 0, "shuffle": None}
    a = {**head, "stages": [{"world": [1, 2], "delivered": [5, None]}]}
    b = {**head, "stages": [{"world": [1, 2], "delivered": [None, 7]}]}
    assert streamdata.merge_states([a, b])["stages"][0]["delivered"] == [5, 7]
