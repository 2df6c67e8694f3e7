"""sd.audio on tones made here (tests/media/synth.py): a segment's samples are the signal's at the
reported start, seeded (IMAGE-SEED); soundfile for WAV/FLAC, PyAV for the rest; corrupt files
are FormatErrors naming the sample."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import streamdata as sd
from tests.media.synth import audio_bytes, tone

RATE = 16000


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
@pytest.mark.parametrize("backend", ["auto", "soundfile", "av"])
def test_a_segment_is_the_signal_at_its_start(fmt, backend):
    data = audio_bytes(3.0, RATE, channels=2, fmt=fmt)
    signal = tone(3.0, RATE, channels=2).T
    starts = set()
    for seed in range(5):
        out = sd.audio.RandomSegment(0.5, backend=backend, seed=seed)(data)
        samples = out["samples"]
        assert samples.dtype == torch.float32 and samples.shape == (2, 8000) and out["sample_rate"] == RATE
        first = round(out["start"] * RATE)
        assert out["start"] * RATE == pytest.approx(first)  # a whole sample
        np.testing.assert_allclose(samples.numpy(), signal[:, first:first + 8000], atol=1e-6)
        starts.add(first)
    assert len(starts) == 5


def test_seeded_by_seed_epoch_and_key():
    data = audio_bytes(2.0, RATE)
    sample = {"__key__": "a1", "__url__": "s3://b/shard-000.tar", "wav": data}
    seg = sd.audio.RandomSegment(0.25)
    first = seg.for_pass(3, 0)(sample)["wav"]["start"]
    assert seg.for_pass(3, 0)(sample)["wav"]["start"] == first
    assert len({seg.for_pass(3, e)(sample)["wav"]["start"] for e in range(6)}) > 3


def test_ogg_mono_resampled_and_whole():
    data = audio_bytes(2.0, RATE, channels=2, fmt="OGG")
    out = sd.audio.RandomSegment(0.5, sample_rate=8000, mono=True, seed=1)(data)
    assert out["samples"].shape == (1, 4000) and out["sample_rate"] == 8000
    whole = sd.audio.Decode()(audio_bytes(1.0, RATE, channels=3))
    assert whole["samples"].shape == (3, RATE) and whole["start"] == 0.0
    np.testing.assert_allclose(whole["samples"].numpy(), tone(1.0, RATE, 3).T, atol=1e-6)
    # resampled: the 440 Hz tone is still 440 Hz
    low = sd.audio.Decode(sample_rate=8000)(audio_bytes(1.0, RATE, channels=1))["samples"][0].numpy()
    assert low.shape == (8000,) and np.argmax(np.abs(np.fft.rfft(low))) == 440


def test_a_segment_longer_than_the_file_is_padded():
    out = sd.audio.RandomSegment(2.0)(audio_bytes(0.5, RATE, channels=1))
    assert out["samples"].shape == (1, 2 * RATE) and out["start"] == 0.0
    assert torch.count_nonzero(out["samples"][:, RATE // 2:]) == 0


def test_corrupt_and_truncated_audio_are_format_errors():
    good = audio_bytes(1.0, RATE, fmt="FLAC")
    for bad in (b"RIFF" + b"\x00" * 100, b"fLaC garbage", b"\x01\x02" * 300):
        with pytest.raises(sd.FormatError) as info:
            sd.audio.RandomSegment(0.5)({"__key__": "a7", "__url__": "s3://b/s.tar", "flac": bad})
        assert info.value.key == "a7" and info.value.url == "s3://b/s.tar"
    assert sd.audio.RandomSegment(0.5)(good)["samples"].shape == (2, 8000)


def test_a_missing_backend_names_its_extra(monkeypatch):
    data = audio_bytes(1.0)
    monkeypatch.setitem(sys.modules, "soundfile", None)  # `import soundfile` fails, as where not installed
    with pytest.raises(sd.BackendMissingError, match=r"streamdata\[audio\]"):
        sd.audio.RandomSegment(0.5, backend="soundfile")(data)
    # "auto" falls back to PyAV for WAV without soundfile
    assert sd.audio.RandomSegment(0.5)(data)["samples"].shape == (2, 8000)
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(sd.BackendMissingError, match=r"streamdata\[audio\]"):
        sd.audio.RandomSegment(0.5)(data)


def test_bad_arguments_are_spec_errors():
    for make in (lambda: sd.audio.RandomSegment(0), lambda: sd.audio.RandomSegment(1.0, sample_rate=0),
                 lambda: sd.audio.RandomSegment(1.0, backend="x")):
        with pytest.raises(sd.SpecError):
            make()
