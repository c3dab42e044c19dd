"""Clean exits under torchrun: N consecutive 2-rank runs of a script for a few steps (CPU, gloo), each must exit 0.

    python benchmarks/torchrun_exits.py --runs 20 --steps 1

Prints each run's exit code and time, and the count of failures (a failure's last stderr lines too). A rank that tore
the process group down while another still used it used to abort with SIGABRT in ~3% of runs (2 of 67)."""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--script", default="grpo.py")
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--failures", default=None, help="write each failed run's whole stderr here (a directory)")
    a = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONFAULTHANDLER="1")  # stacks on abort
    failed = 0
    for i in range(a.runs):
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", a.script]
            cmd += ["--total-steps", str(a.steps), "--prompts-per-step", "4", "--eval-every", "0", "--num-eval", "4"]
            cmd += ["--device", "cpu", "--output-dir", out] + (["--fsdp"] if a.fsdp else [])
            t0 = time.time()
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            failed += r.returncode != 0
            print(f"run {i + 1}: exit {r.returncode} in {time.time() - t0:.1f} s", flush=True)
            if r.returncode:
                print("\n".join(r.stderr.splitlines()[-5:]))
                if a.failures:
                    Path(a.failures).mkdir(parents=True, exist_ok=True)
                    (Path(a.failures) / f"run{i + 1}.stderr").write_text(r.stderr)
    print(f"{a.runs - failed} of {a.runs} runs exited 0 ({a.script}, {a.steps} step(s){', --fsdp' if a.fsdp else ''})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
