"""What the benchmarks that run a training script share: start it as a user would (a fresh process, into a temporary
--output-dir) and read back its metrics.jsonl, its exit status, its wall time and its own peak memory.

    from harness import run_script
    res = run_script(["grpo.py", "--total-steps", "4"], threads=2).check()   # exits with the stderr tail on failure
    res.steps, res.wall_s, res.peak_rss_mb

Peak memory is the child's own high-water mark (Linux VmHWM, read inside it when it ends), not wait4's ru_maxrss:
subprocess starts the child with vfork + exec, and Linux then reports the *parent's* high-water mark for the child
(and in the child's own RUSAGE_SELF) whenever the parent's is higher, e.g. after the benchmark built a model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# `python -c CHILD PEAK_FILE ARGS...` runs `python ARGS...` (a script path or `-c CODE`) in this process and writes its
# peak RSS (MiB) to PEAK_FILE when it ends, whatever way it ends short of being killed.
CHILD = r"""
import os, runpy, sys
peak_file, sys.argv = sys.argv[1], sys.argv[2:]


def peak_mb():
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):  # no procfs: the process's own maximum (KiB on Linux)
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


try:
    if sys.argv[0] == "-c":
        code, sys.argv = sys.argv[1], ["-c", *sys.argv[2:]]
        import __main__

        exec(compile(code, "<string>", "exec"), __main__.__dict__)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python script.py` sets it
        runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    with open(peak_file, "w") as f:
        f.write(repr(peak_mb()))
"""


@dataclass
class Result:
    cmd: list[str]  # what a user would type (the temporary --output-dir is gone once run_script returns)
    returncode: int
    rows: list[dict] = field(default_factory=list)  # every row of the run's metrics.jsonl
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0  # start of the process to its end
    peak_rss_mb: float | None = None  # the child's own peak resident set (MiB); None when it was killed
    files: dict[str, bytes] = field(default_factory=dict)  # `keep`: the run directory's files of those names

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def steps(self) -> list[dict]:
        """The rows of optimizer steps (the ones with time/step; evaluation rows are left out)."""
        return [r for r in self.rows if "time/step" in r]

    def tail(self, n: int = 3000) -> str:
        return self.stderr[-n:]

    def check(self, label: str | None = None) -> Result:
        """self when the run succeeded; otherwise the process exits with the command and its stderr's tail."""
        if not self.ok:
            sys.exit(f"{label or ' '.join(self.cmd)} failed:\n{self.tail()}")
        return self


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl: `path` is the file, a run directory holding it, or an --output-dir holding one run
    directory. [] when there is none (a script that failed before logging)."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("metrics.jsonl")) or sorted(path.glob("*/metrics.jsonl"))
        if len(found) > 1:
            raise ValueError(f"{path} holds several runs: {[str(f.parent) for f in found]}")
        path = found[0] if found else path / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_script(
    args: list[str],
    cwd: str | Path = ROOT,
    threads: int | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    output_dir: bool = True,
    keep: tuple[str, ...] = (),
) -> Result:
    """Run `python *args --output-dir <tmp>` in `cwd` (args: a script and its flags, or ["-c", code, ...]) and collect
    its metrics. threads: OMP_NUM_THREADS for the child. env: variables added to this process's environment (with
    PYTHONUNBUFFERED=1). output_dir=False: no --output-dir flag. A timeout kills the child (returncode -9).
    keep: names of files in the run directory (e.g. credit.jsonl) whose bytes come back in Result.files."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads is not None:
        full_env["OMP_NUM_THREADS"] = str(threads)
    full_env.update(env or {})
    with tempfile.TemporaryDirectory() as tmp:
        out, peak_file = Path(tmp) / "out", Path(tmp) / "peak_mb"
        out.mkdir()
        user_args = [*args, "--output-dir", str(out)] if output_dir else list(args)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, str(peak_file), *user_args],
                cwd=cwd,
                env=full_env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:  # run() killed the child; what it had written so far (bytes)
            decode = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
            rc, stdout, stderr = -9, decode(e.stdout), decode(e.stderr) + f"\ntimed out after {timeout} s"
        wall = time.perf_counter() - t0
        peak = float(peak_file.read_text()) if peak_file.exists() and peak_file.read_text() else None
        files = {name: f.read_bytes() for name in keep for f in sorted(out.glob(f"*/{name}"))[:1]}
        return Result(
            cmd=[Path(sys.executable).name, *user_args],
            returncode=rc,
            rows=read_metrics(out),
            stdout=stdout,
            stderr=stderr,
            wall_s=wall,
            peak_rss_mb=peak,
            files=files,
        )
