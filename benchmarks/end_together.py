"""Per-step cost of END-TOGETHER: the one-integer all-reduce sd.loader runs before each batch
of a multi-rank job (streamdata/together.py), against the same loop without it.

    python -m benchmarks.end_together            # starts 2 ranks with torchrun (gloo, CPU)
    python -m benchmarks.end_together --ranks 4 --steps 5000

Each rank iterates a list of ready batches, wrapped and not, in alternating rounds, and rank
0 prints microseconds per step (median of the rounds) for both and their difference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def _rank_main(steps: int, rounds: int) -> None:
    import torch.distributed as dist

    from streamdata.feed.together import EndTogether

    dist.init_process_group("gloo")
    together = EndTogether()
    batches = list(range(steps))
    per_step: dict[str, list[float]] = {"plain": [], "end_together": []}
    for _ in range(rounds):
        for name in per_step:
            dist.barrier()
            start = time.perf_counter()
            source = iter(batches) if name == "plain" else together.wrap(iter(batches))
            for _ in source:
                pass
            per_step[name].append((time.perf_counter() - start) / steps * 1e6)
    if dist.get_rank() == 0:
        plain, wrapped = (statistics.median(per_step[k]) for k in ("plain", "end_together"))
        print(f"{dist.get_world_size()} ranks, gloo on loopback, {steps} steps x {rounds} rounds: "
              f"plain {plain:.1f} us/step, with END-TOGETHER {wrapped:.1f} us/step, "
              f"cost {wrapped - plain:.1f} us per step")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        _rank_main(args.steps, args.rounds)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           "-m", "benchmarks.end_together", "--rank-main", "--steps", str(args.steps),
           "--rounds", str(args.rounds)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, timeout=600)


if __name__ == "__main__":
    main()
