"""LAZY-DECODERS (streamdata/decode.py): ``decode=True`` gives what webdataset's handlers give,
without importing webdataset unless a field needs it."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from webdataset import autodecode

import streamdata as sd
from streamdata.formats import decode as D


def _webdataset_default():
    """What ``decode=True`` was before LAZY-DECODERS: webdataset's Decoder with our fast handlers."""
    return D._Decode(autodecode.Decoder([D.fast_npy, D.fast_basic, autodecode.ImageHandler("torchrgb8")]))


def _image(fmt: str, mode: str, rng: random.Random) -> bytes:
    h, w = rng.randint(1, 9), rng.randint(1, 9)
    channels = {"L": 1, "RGB": 3, "RGBA": 4, "P": 1, "1": 1}[mode]
    pixels = np.array([rng.randrange(256) for _ in range(h * w * channels)], dtype=np.uint8)
    pixels = pixels.reshape(h, w, channels)
    image = Image.fromarray(pixels[..., 0] if channels == 1 else pixels).convert(mode)
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def _fields(rng: random.Random) -> dict[str, bytes]:
    """One of each kind of field a shard may hold, in random variants."""
    shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 3)))
    dtype = rng.choice(["<f4", ">f8", "<i2", "|u1", "<c8", "|b1"])
    array = np.arange(int(np.prod(shape)) if shape else 1).astype(dtype).reshape(shape)
    fields = {
        "npy": _npy(array),
        "f.npy": _npy(np.asfortranarray(np.arange(12.0).reshape(3, 4))),
        "cls": str(rng.randint(-5, 5000)).encode(),
        "CLS": b" 42\n",
        "index": b"7",
        "txt": "héllo wörld".encode(),
        "text": b"plain",
        "transcript": b"said",
        "json": json.dumps({"a": [1, 2.5, None], "b": "x"}).encode(),
        "jsn": b"[1, 2]",
        "JSON": b'{"upper": true}',
        "pyd": pickle.dumps({"p": (1, 2)}),
        "npz": _npz(),
        "json.gz": gzip.compress(b'{"z": 1}'),
        "TXT.gz": gzip.compress(b"zipped"),
        "CLS.gz": gzip.compress(b"12"),
        "f.npy.gz": gzip.compress(_npy(np.asfortranarray(np.arange(6.0).reshape(2, 3)))),
        "seg.bin": bytes(rng.randrange(256) for _ in range(rng.randint(0, 40))),
        "seg": b"\x00\x01raw",
        "weird.name.cls": b"3",
    }
    for fmt, ext in [("PNG", "png"), ("JPEG", "jpg"), ("JPEG", "jpeg"), ("GIF", "gif"), ("BMP", "bmp"),
                     ("TIFF", "tif"), ("WEBP", "webp"), ("PPM", "ppm")]:
        modes = ["RGB", "L"] + (["RGBA"] if fmt in ("PNG", "TIFF", "WEBP") else [])
        modes += ["P"] if fmt in ("PNG", "GIF") else []
        mode = rng.choice(modes)
        fields[f"{mode.lower()}.{ext}"] = _image(fmt, mode, rng)
    fields["upper.PNG"] = _image("PNG", "RGBA", rng)
    return fields


def _npz() -> bytes:
    out = io.BytesIO()
    np.savez(out, a=np.arange(3), b=np.eye(2))
    return out.getvalue()


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous() == b.is_contiguous() and bool(
            torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return (a.dtype == b.dtype and a.shape == b.shape and a.flags.c_contiguous == b.flags.c_contiguous
                and a.flags.writeable == b.flags.writeable and np.array_equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("seed", range(12))
def test_the_default_decodes_every_kind_of_field_as_webdataset_does(seed):
    rng = random.Random(seed)
    sample = {"__key__": f"k{seed}", "__url__": "s3://b/x.tar", **_fields(rng)}
    ours, theirs = D.make_decoder(True)(dict(sample)), _webdataset_default()(dict(sample))
    assert ours.keys() == theirs.keys() == sample.keys()
    for field in sample:
        assert _same(ours[field], theirs[field]), field
    assert ours["cls"] == int(sample["cls"]) and ours["json.gz"] == {"z": 1}
    assert ours["TXT.gz"] == "zipped" and ours["CLS.gz"] == 12 and ours["f.npy.gz"].flags.c_contiguous
    assert ours["JSON"] == sample["JSON"] and ours["seg"] == sample["seg"]  # not decoded, as before
    assert tuple(ours["upper.PNG"].shape)[0] == 3 and ours["upper.PNG"].dtype == torch.uint8


def test_our_image_formats_are_among_webdatasets():
    assert D.IMAGE_EXTENSIONS <= set(autodecode.IMAGE_EXTENSIONS)


def _truncated_png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3)).save(out, format="PNG")
    return out.getvalue()[:-40]  # the last image data and the end chunk cut off


_TRUNCATED_PNG = _truncated_png()


@pytest.mark.parametrize("field, data", [
    ("npy", b"not npy"), ("cls", b"seven"), ("json", b"{bad"), ("png", b"\x89PNG broken"),
    ("txt", b"\xff\xfe"), ("pyd", b"not a pickle"), ("png", _TRUNCATED_PNG),
])
def test_a_field_that_cannot_be_decoded_is_a_decode_error_like_before(field, data):
    sample = {"__key__": "k0", "__url__": "s3://b/bad.tar", field: data}
    with pytest.raises(sd.DecodeError) as ours:
        D.make_decoder(True)(dict(sample))
    with pytest.raises(sd.DecodeError) as theirs:
        _webdataset_default()(dict(sample))
    def address_free(text: str) -> str:
        return re.sub(r"0x[0-9a-f]+", "0x?", text)

    assert address_free(str(ours.value)) == address_free(str(theirs.value))
    text = str(ours.value)
    assert f"field {field!r}" in text and "'k0'" in text and "bad.tar" in text
    assert ours.value.url == "s3://b/bad.tar" and ours.value.key == "k0"


def test_the_default_decoder_pickles_without_webdatasets_half():
    decoder = D.make_decoder(True)
    decoder({"__key__": "k", "pyd": pickle.dumps(1)})  # builds webdataset's decoder here
    again = pickle.loads(pickle.dumps(decoder))
    got = again({"__key__": "k", "cls": b"4", "pyd": pickle.dumps(2)})
    assert got == {"__key__": "k", "cls": 4, "pyd": 2}


_PROBE = """
import io, json, pickle, sys
import numpy as np
from PIL import Image
import streamdata as sd
from streamdata.formats.decode import make_decoder
png = io.BytesIO(); Image.new("RGB", (2, 3)).save(png, format="PNG")
npy = io.BytesIO(); np.save(npy, np.arange(4.0))
decode = make_decoder(True)
out = decode({"__key__": "k", "npy": npy.getvalue(), "cls": b"1", "txt": b"t", "json": b"{}",
              "png": png.getvalue()})
assert out["cls"] == 1 and tuple(out["png"].shape) == (3, 3, 2), out
before = "webdataset" in sys.modules
decode({"__key__": "k", "pyd": pickle.dumps(5)})
print(json.dumps([before, "webdataset" in sys.modules, "yaml" in sys.modules]))
"""


@pytest.mark.slow
def test_the_default_imports_webdataset_only_for_a_field_that_needs_it():
    """A fresh interpreter: the default decoder decodes npy, ints, text, json and a png without
    webdataset; a pickle field (webdataset's handler) imports it."""
    out = subprocess.run([sys.executable, "-c", _PROBE],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, yaml = json.loads(out.stdout.strip().splitlines()[-1])
    assert before is False and after is True


def test_the_tar_dataset_constructor_imports_no_webdataset(tmp_path):
    from tests.helpers import make_samples, tar_bytes

    (tmp_path / "a.tar").write_bytes(tar_bytes(make_samples([3])[0]))
    code = (f"import sys, streamdata as sd\nds = sd.TarDataset({str(tmp_path / 'a.tar')!r})\n"
            "assert 'webdataset' not in sys.modules, 'constructor'\n"
            "got = list(ds)\nassert [s['cls'] for s in got] == [0, 1, 2], got\n"
            "assert 'webdataset' not in sys.modules, 'decoding npy, cls and json'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert out.returncode == 0, out.stderr
