"""``decode_on="device"`` on a CUDA device: nvJPEG (torchvision) or nvImageCodec against the CPU
path, in process (PSNR bound: the device decodes in full, the CPU path at a DCT scale where the
crop allows), and a short sd.loader(device="cuda") epoch with workers: every image once, on the
GPU, the CPU path's crops. Skipped without CUDA (tests/conftest.py); the CPU half of this path
is tests/feed/test_device_images.py."""

from __future__ import annotations

import pytest
import torch

import streamdata as sd
from streamdata.batch.collate import collate
from streamdata.feed import images as F
from streamdata.formats import images as I
from tests.feed.test_device_images import _corrupt_scan, _samples
from tests.formats.test_images import _encode, _image_shards, _picture, _psnr

pytestmark = pytest.mark.cuda


def test_nvjpeg_against_the_cpu_path():
    samples = _samples(9, (640, 480))
    samples[4]["jpg"] = _encode(_picture(4, (640, 480)), "PNG")  # finished in the worker
    samples[5]["jpg"] = _encode(_picture(5, (333, 251)), mode="L")  # grayscale: RGB out
    cpu = I.RandomResizedCrop(224).for_pass(1, 0)
    dev = I.RandomResizedCrop(224, decode_on="device").for_pass(1, 0)
    batch = collate([dev(s) for s in samples])
    before = F.counts()
    got = sd.finish_images(batch, torch.device("cuda"))["jpg"]
    torch.cuda.synchronize()
    assert got.is_cuda and got.shape == (9, 3, 224, 224) and got.dtype == torch.uint8
    assert F.counts()["cpu_fallback"] == before["cpu_fallback"]  # the device decoded every JPEG
    for i, sample in enumerate(samples):
        assert _psnr(got[i].cpu(), cpu(sample)["jpg"].numpy()) >= 30, i


def test_a_corrupt_scan_on_the_gpu_is_named_or_decoded_and_the_others_are_right():
    """nvJPEG decodes a scan damaged inside its data without an error (measured on an H200: the
    image comes out wrong, not refused), where libjpeg-turbo refuses it; either way the batch
    finishes or fails naming that sample, and its good images are the CPU path's."""
    samples = _samples(3)
    samples[2]["jpg"] = _corrupt_scan(samples[2]["jpg"])
    batch = collate([I.RandomResizedCrop(32, decode_on="device").for_pass(1, 0)(s) for s in samples])
    try:
        got = sd.finish_images(batch, torch.device("cuda"))["jpg"]
    except sd.DecodeError as exc:
        assert exc.key == "k2" and exc.url == "s3://bkt/train-0.tar"
        return
    assert got.shape == (3, 3, 32, 32) and got.is_cuda
    cpu = I.RandomResizedCrop(32).for_pass(1, 0)
    for i in (0, 1):
        assert _psnr(got[i].cpu(), cpu(samples[i])["jpg"].numpy()) >= 30, i


def test_sd_loader_on_cuda_decodes_on_the_gpu(tmp_path):
    """Local shards: a GPU machine need not have the S3 server's packages."""
    import fsspec

    keys = _image_shards(fsspec.filesystem("file", auto_mkdir=True), str(tmp_path / "img"), [6, 6, 6, 6])
    spec = str(tmp_path / "img" / "shard-{000..003}.tar")

    def run(decode_on: str) -> dict[str, torch.Tensor]:
        ds = sd.TarDataset(spec, batch_size=4, shuffle=True, seed=3,
                           decode=sd.images.RandomResizedCrop(32, decode_on=decode_on))
        out: dict[str, torch.Tensor] = {}
        with sd.loader(ds, num_workers=2, device="cuda") as loader:
            for batch in loader:
                assert batch["jpg"].is_cuda and batch["jpg"].dtype == torch.uint8
                out.update({k: v.cpu() for k, v in zip(batch["__key__"], batch["jpg"], strict=True)})
        return out

    gpu, cpu = run("device"), run("worker")
    assert sorted(gpu) == keys == sorted(cpu)
    assert all(_psnr(gpu[k], cpu[k].numpy()) >= 30 for k in keys)


def test_an_encoded_batch_pins_as_a_batch_does():
    """DataLoader's pin thread calls ``pin_memory()``; sd.pin_batch walks the dataclass: every
    tensor page-locked, the keys kept."""
    batch = collate([I.RandomResizedCrop(32, decode_on="device")(s) for s in _samples(3)])
    for pinned in (batch["jpg"].pin_memory(), sd.pin_batch(batch)["jpg"]):
        assert all(t.is_pinned() for t in (pinned.data, pinned.offsets, pinned.boxes, pinned.flips,
                                           pinned.sizes, pinned.kinds))
        assert pinned.keys == ["k0", "k1", "k2"]
