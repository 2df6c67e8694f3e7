#!/usr/bin/env bash
# The GPU check: streamdata's CUDA tests and benchmarks/gpu_feed.py on a machine with a CUDA device.
#
#   bash benchmarks/gpu_check.sh [LOG_DIR]      # from the repository root; LOG_DIR: benchmarks/results/gpu
#
# Installs nothing: streamdata's dependencies must import (torch, numpy, aiohttp, fsspec,
# pyarrow, pillow, webdataset, braceexpand; pytest, pytest-timeout, psutil; torchdata for
# tests/test_resume_loaders.py; torchvision built for the installed torch, or nvImageCodec, for the
# GPU decode; scikit-image and simplejpeg for the image benchmark).  Runs, each step bounded by `timeout` (about 11 minutes in
# all, even if something hangs), each step whatever the one before did:
#   1. the tests marked `cuda`                              -> pytest_cuda.log
#   2. the whole test files that touch the CUDA code, without the S3 / GCS servers and slow
#      tests (so the `cuda` tests run a second time)          -> pytest_files.log
#   3. python benchmarks/gpu_feed.py                           -> gpu_feed.log, gpu_feed.json
#   4. python -m benchmarks.images --gpu (nvJPEG decode against the CPU path, local shards,
#      3,072 images, 2 rounds)                                  -> images_gpu.log
#   5. python benchmarks/gpu_metrics.py (loader.metrics() with device="cuda" against a stopwatch,
#      steps of 5 ms)                                           -> gpu_metrics.log
# plus env.log (device, versions, /dev/shm) and summary.txt, the one line printed at the end.
# The exit status is 0 only if every step passed.
set -u -o pipefail

out=${1:-benchmarks/results/gpu}
py=${PYTHON:-python3}
mkdir -p "$out"

run() {  # run SECONDS LOG COMMAND...: bounded, tee'd to LOG; returns the command's status
    local seconds=$1 log=$2
    shift 2
    echo "\$ $*" >"$log"
    timeout -k 10 "$seconds" "$@" 2>&1 | tee -a "$log"
    local rc=$?
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "gpu_check: stopped after ${seconds} s" | tee -a "$log"
    return "$rc"
}

last_line() {  # pytest's closing line, e.g. "12 passed, 2 skipped in 30.1s"
    grep -E '[0-9]+ (passed|failed|error|errors|skipped|deselected)' "$1" | tail -n 1 | tr -d '='
}

{
    echo "date: $(date -u +%FT%TZ)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    timeout 60 "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__,
"| cuda", torch.version.cuda, "| available", torch.cuda.is_available(),
"|", torch.cuda.get_device_name() if torch.cuda.is_available() else "-")' 2>&1
    timeout 60 "$py" -c 'import importlib.metadata as m
for name in ("numpy", "webdataset", "braceexpand", "torchdata", "aiohttp", "fsspec", "pyarrow", "pytest",
             "torchvision", "nvidia-nvimgcodec-cu12", "simplejpeg"):
    try: print(name, m.version(name))
    except m.PackageNotFoundError: print(name, "MISSING")' 2>&1
    echo "cpus: $(nproc)"
    df -h /dev/shm 2>&1 | tail -n 1
} >"$out/env.log" 2>&1
cat "$out/env.log"

pytest=("$py" -m pytest -q -p no:cacheprovider --timeout 60)

cuda_files=$(grep -rl --include='test_*.py' 'mark\.cuda' tests | sort | tr '\n' ' ')
# shellcheck disable=SC2086  # one word per file
run 100 "$out/pytest_cuda.log" "${pytest[@]}" -rfEsP -m cuda $cuda_files
cuda_rc=$?

files=(tests/feed/test_cuda.py tests/feed/test_loader.py tests/batch/test_recycle.py tests/batch/test_collate.py
       tests/batch/test_incremental.py tests/feed/test_resume_loaders.py tests/feed/test_device_images.py
       tests/test_imports.py tests/test_layers.py)
run 110 "$out/pytest_files.log" "${pytest[@]}" -rfEs -m 'not slow and not s3 and not gcs' "${files[@]}"
files_rc=$?

rm -f benchmarks/results/gpu_feed.json
run 160 "$out/gpu_feed.log" "$py" benchmarks/gpu_feed.py
feed_rc=$?
[ -f benchmarks/results/gpu_feed.json ] && cp benchmarks/results/gpu_feed.json "$out/gpu_feed.json"

run 120 "$out/images_gpu.log" "$py" -m benchmarks.images --gpu --images 3072 --per-shard 128 --rounds 2
images_rc=$?

run 90 "$out/gpu_metrics.log" "$py" benchmarks/gpu_metrics.py --step-ms 5
metrics_rc=$?

summary="gpu_check: cuda tests rc=$cuda_rc ($(last_line "$out/pytest_cuda.log")); \
test files rc=$files_rc ($(last_line "$out/pytest_files.log")); \
gpu_feed rc=$feed_rc ($(grep -E '^prefetcher / blocking' "$out/gpu_feed.log" | tail -n 1 || true)); \
images --gpu rc=$images_rc ($(grep -E 'gpu / cpu path on' "$out/images_gpu.log" | tail -n 1 || true)); metrics rc=$metrics_rc ($(grep -E '^gpu_metrics:' "$out/gpu_metrics.log" | tail -n 1 || true))"
echo "$summary" | tee "$out/summary.txt"
[ "$cuda_rc" -eq 0 ] && [ "$files_rc" -eq 0 ] && [ "$feed_rc" -eq 0 ] && [ "$images_rc" -eq 0 ] && [ "$metrics_rc" -eq 0 ]
