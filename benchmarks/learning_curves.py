"""Benchmark: eval accuracy of every method against step and against generated tokens, with 95% intervals.

Two parts, so that hours of runs can be done in pieces and the report rebuilt from the raw metrics:

    python benchmarks/learning_curves.py run --setting headroom --seeds 1 2 3 4 5      # the runs (hours on 2 cores)
    python benchmarks/learning_curves.py report --setting headroom                     # table + plots from the results

`run` starts each (method, seed) as a user would (a subprocess of the script with its defaults, plus the
setting's flags), `--workers` at a time with `--threads` torch threads each, and keeps each run's whole
metrics.jsonl as benchmarks/results/<setting>/<method>/seed<k>.jsonl, beside a meta.json naming the flags and the
git commit. A run whose file is complete is skipped, so an interrupted `run` continues where it stopped, and
several `run` processes may share the work (each (method, seed) is claimed with a lock file; remove stale
*.lock files after an interruption).

`report` prints and writes benchmarks/results/<setting>/report.md: final greedy pass@1 (mean over seeds with its 95%
Student-t interval over seeds), its difference from GRPO paired by seed (same seed: same held-out problems; the mean of
the per-seed differences over the n seeds both finished, with their 95% t-interval) and the lowest per-seed ratio to
GRPO's final (a collapse on one seed), the mean accuracy over all evaluations (step 0 included; a less noisy view of
speed than one crossing) and its difference from GRPO's paired by seed (the evaluations after step 0: less hostage to
one evaluation than the final), the first evaluated step at which each method's mean curve reaches GRPO's final mean
accuracy over the same seeds (and the same in generated tokens), and plots of accuracy against step and against
generated tokens (mean and 95% t band) in docs/img/ (for another --results folder: beside its report.md): one for the
methods at their defaults, one per swept method for its `--tag` sweeps beside it (needs matplotlib: pip install -r
benchmarks/requirements.txt). `report --json` prints one JSON line per method instead (`versus_grpo` defines its fields)
and writes nothing. Intervals are t-intervals (`t_interval`), not a bootstrap: over 3 seeds a percentile bootstrap of
the mean covers far less than 95%.

Settings (the bundled tiny model, the built-in arith task):
  default   the default run: 4 operations, values <= 99 (GRPO starts ~0.7: little headroom)
  headroom  6 operations, running values <= 150, 80 new tokens: GRPO starts near 0.4 and is still rising at 150 steps
            (the model was trained on 2-6 operations and values <= 99, so the larger values are what RL must teach)
  hard      6 operations, running values <= 400: most of GRPO's groups solve nothing
  long      16 easy operations (values <= 99, operands <= 9) with the second bundled model, assets/tiny-arith-long
            (trained on 2-16 operations): ~130-token solutions that fail by compounding, late (docs/benchmarks.md)

`python benchmarks/learning_curves.py flags --setting long` prints a setting's script flags on one line.
"""

import argparse
import gzip
import json
import math
import os
import random
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import read_metrics, run_script

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SETTINGS = {
    "default": [],
    "headroom": ["--arith-steps", "6", "--arith-max-value", "150", "--max-new-tokens", "80"],
    "hard": ["--arith-steps", "6", "--arith-max-value", "400", "--max-new-tokens", "80"],
    "long": ["--model", "assets/tiny-arith-long", "--arith-steps", "16", "--max-new-tokens", "180"],
    "rising": ["--arith-steps", "6", "--arith-variant", "rising", "--max-new-tokens", "80"],  # GRPO-λ's premise (#67)
}
METHODS = {
    "grpo": ["grpo.py"],
    "sc_grpo": ["sc_grpo.py"],
    "grpo_lambda": ["grpo_lambda.py"],
    "ep_grpo": ["ep_grpo.py"],
    "srpo": ["srpo.py", "--reset", "self"],
    "rrpo": ["srpo.py", "--reset", "random"],
    "srpo_oracle": ["srpo.py", "--reset", "oracle"],
    "control": ["benchmarks/perfect_credit.py"],  # the positive control: perfect process credit (not a method)
    "placebo": ["benchmarks/perfect_credit.py", "--placebo"],  # its mass-matched placebo: the same |A|, no location
    "grpo_aa": ["grpo.py", "--micro-batch-size", "8"],  # A/A: GRPO with another update chunking (no rule changes)
}


def result_path(setting: str, name: str, seed: int, results: Path = RESULTS) -> Path:
    return results / setting / name / f"seed{seed}.jsonl"


def credit_path(metrics: Path) -> Path:
    """Where a run's --log-credit records are kept: seed<k>.credit.jsonl.gz beside its seed<k>.jsonl."""
    return metrics.with_name(metrics.stem + ".credit.jsonl.gz")


def complete(path: Path, steps: int) -> bool:
    rows = read_metrics(path)
    return bool(rows) and rows[-1].get("step") == steps and "eval/accuracy" in rows[-1]


def run_one(setting: str, name: str, script_flags: list[str], seed: int, a) -> str:
    """One training run in a subprocess; its metrics.jsonl is copied to the results (atomically)."""
    out = result_path(setting, name, seed, Path(a.results))
    if complete(out, a.steps):
        return f"{name} seed {seed}: done already"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:  # another `run` process may work on the same results: each (method, seed) is claimed once
        os.close(os.open(out.with_suffix(".lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return f"{name} seed {seed}: claimed by another process ({out.with_suffix('.lock')})"
    script, *flags = script_flags
    flags += [*SETTINGS[setting], "--total-steps", str(a.steps), "--eval-every", str(a.eval_every), "--seed", str(seed)]
    log_credit = ["--log-credit", str(a.log_credit)] if getattr(a, "log_credit", 0) else []  # recorded, not changed
    try:
        res = run_script([script, *flags, *a.extra.split(), *log_credit], threads=a.threads, keep=("credit.jsonl",))
    finally:
        out.with_suffix(".lock").unlink(missing_ok=True)
    if not res.ok:
        return f"{name} seed {seed}: FAILED ({' '.join(res.cmd)})\n{res.tail(2000)}"
    if "credit.jsonl" in res.files:  # --log-credit: the per-token credit, gzipped beside the metrics (written first)
        tmp_credit = out.with_suffix(".credit.tmp")
        tmp_credit.write_bytes(gzip.compress(res.files["credit.jsonl"], mtime=0))
        os.replace(tmp_credit, credit_path(out))
    tmp_run = out.with_suffix(".run.tmp")  # the run's provenance beside its rows (what `report` pools by)
    not_default = [*script_flags[1:], *SETTINGS[setting], *a.extra.split(), *log_credit]
    record = provenance([script, *flags, *a.extra.split(), *log_credit], not_default, a, res.wall_s)
    tmp_run.write_text(json.dumps(record, indent=1))
    os.replace(tmp_run, run_path(out))
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text("".join(json.dumps(r) + "\n" for r in res.rows))  # as the script wrote them (json.dumps)
    os.replace(tmp_out, out)
    return f"{name} seed {seed}: {res.wall_s:.0f} s"


def run_path(metrics: Path) -> Path:
    """A run's provenance: seed<k>.run.json beside its seed<k>.jsonl."""
    return metrics.with_name(metrics.stem + ".run.json")


def cpu_name() -> str:
    """The processor's model name (Linux /proc/cpuinfo), else platform's."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(x.split(":", 1)[1].strip() for x in lines if x.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or "unknown processor"


def provenance(command: list[str], not_default: list[str], a, wall_s: float) -> dict:
    """What produced a run: the commit (and whether the tree had uncommitted changes), the full command, the flags that
    differ from the script's defaults (the method's, the setting's, --extra's), the machine, torch and Python."""
    import platform

    import torch

    git = lambda *c: subprocess.run(["git", *c], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {
        "commit": git("rev-parse", "HEAD"),
        "uncommitted": bool(git("status", "--porcelain", "-uno")),
        "command": command,
        "flags_not_default": not_default,
        "machine": f"{platform.node()}: {platform.machine()}, {os.cpu_count()} cores, {cpu_name()}",
        "threads": a.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "wall_s": round(wall_s, 1),
        "finished": __import__("datetime").datetime.now().isoformat(timespec="seconds"),
    }


def cmd_run(a) -> None:
    names = a.methods or list(METHODS)
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        sys.exit(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    tag = f"@{a.tag}" if a.tag else ""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for m in names:
        meta = Path(a.results) / a.setting / (m + tag) / "meta.json"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(
            json.dumps(
                {
                    "command": METHODS[m] + SETTINGS[a.setting] + a.extra.split(),
                    "steps": a.steps,
                    "eval_every": a.eval_every,
                    "threads": a.threads,
                    "log_credit": a.log_credit,
                    "commit": commit,
                },
                indent=1,
            )
        )
    jobs = [(m + tag, METHODS[m], seed) for seed in a.seeds for m in names]
    with ThreadPoolExecutor(max_workers=a.workers) as pool:
        for line in pool.map(lambda j: run_one(a.setting, j[0], j[1], j[2], a), jobs):
            print(line, flush=True)


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
SEED_FILE = re.compile(r"seed(\d+)\.jsonl")  # a seed's rows; anything else in a method's folder is not a seed
NUMBERS = ("step", "eval/accuracy", "reset/generated_tokens", "num_tokens")  # what the report computes with


def say(message: str, quiet: bool | None = False) -> None:
    """One line about a results file the report leaves out or reads in part: on stdout, on stderr when `quiet`
    (--json: stdout is JSON), not at all when None (a second reading of files already reported)."""
    if quiet is not None:
        print(message, file=sys.stderr if quiet else sys.stdout)


def seed_files(setting: str, results: Path, quiet: bool | None = False) -> dict:
    """method -> seed -> its seed<k>.jsonl. Only seed<digits>.jsonl are seeds (a backup copy seed1.bak.jsonl is not;
    said); a method folder that is the same files as another's through a link is left out (said)."""
    out, seen = {}, {}  # seen: the real folder, and (device, inode) of each seed file -> the method that has it
    root = results / setting
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        if d.resolve() in seen:
            say(f"skipped {d}: the same folder as {seen[d.resolve()]} (a link); a method is counted once", quiet)
            continue
        seen[d.resolve()] = d.name
        files = {}
        for f in sorted(d.glob("seed*.jsonl")):
            m = SEED_FILE.fullmatch(f.name)
            if m is None:
                say(f"skipped {f}: not a seed's file (only seed<digits>.jsonl are)", quiet)
            else:
                files[int(m.group(1))] = f
        ids = {(f.stat().st_dev, f.stat().st_ino) for f in files.values()}  # hard links, or links to each file
        same = sorted({seen[i] for i in ids if i in seen})
        if same:
            say(f"skipped {d}: the same files as {', '.join(same)} (a link); a method is counted once", quiet)
            continue
        seen |= dict.fromkeys(ids, d.name)
        out[d.name] = files
    return out


def seed_rows(f: Path, quiet: bool | None = False) -> list[dict] | None:
    """A seed's rows, or None (said, in one line) when the report cannot use them: a line that is not JSON (a cut last
    line is dropped with a warning, as runtime.metrics_rows does), a row that is not an object with an integer step, a
    value it computes with that is not a number, an evaluation that is NaN, or no evaluation at the end."""
    try:
        lines = [line for line in f.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        return say(f"skipped {f}: cannot read it ({getattr(e, 'strerror', None) or e})", quiet)
    rows = []
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            if i < len(lines):
                return say(f"skipped {f}: line {i} is not JSON", quiet)
            say(f"warning: {f}:{i}: a partial last line (the run was killed while writing it) is dropped", quiet)
            continue
        if not isinstance(row, dict) or type(row.get("step")) is not int:
            return say(f"skipped {f}: line {i} is not a metrics row (a JSON object with an integer step)", quiet)
        bad = next((k for k in NUMBERS if k in row and type(row[k]) not in (int, float)), None)  # bool: not one
        if bad is not None:
            return say(f"skipped {f}: line {i} (step {row['step']}): {bad} is {row[bad]!r}, not a number", quiet)
        if "eval/accuracy" in row and not math.isfinite(row["eval/accuracy"]):
            what = f"eval/accuracy is {row['eval/accuracy']} at step {row['step']}"
            return say(f"skipped {f}: {what} (an evaluation that failed; left out, not averaged)", quiet)
        rows.append(row)
    if not rows or "eval/accuracy" not in rows[-1]:  # a run that stopped early (run_one writes only finished ones)
        return say(f"skipped {f}: it does not end with an evaluation", quiet)
    return rows


def load(setting: str, results: Path, quiet: bool = False) -> dict:
    """name -> seed -> list of (step, generated tokens so far, eval accuracy) of the finished runs whose rows the
    report can use (seed_files, seed_rows: each file left out is one line; `quiet`: on stderr, for a JSON stdout)."""
    curves = {}
    for name, files in seed_files(setting, results, quiet).items():
        for seed, f in files.items():
            rows = seed_rows(f, quiet)
            if rows is None:
                continue
            tokens, points = 0.0, []
            for r in rows:
                tokens += r.get("reset/generated_tokens", r.get("num_tokens", 0))
                if "eval/accuracy" in r:
                    points.append((r["step"], tokens, r["eval/accuracy"]))
            curves.setdefault(name, {})[seed] = points
    return curves


def read_json(path: Path, quiet: bool | None = False) -> dict:
    """A provenance file (seed<k>.run.json, meta.json) as a dict; {} when it is no JSON object (said)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        say(f"warning: {path}: not a JSON object; the commit it would name is unknown", quiet)
        return {}
    return value


def t_two_sided(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with `df` (a positive integer) degrees of freedom, in closed form (Abramowitz and
    Stegun 26.7.3-4): with theta = atan(t / sqrt(df)), s = sin(theta), c = cos(theta),
      df odd:  (2 / pi) * (theta + s * (c + 2/3 c^3 + (2*4)/(3*5) c^5 + ...
                                       + (2*4*...*(df-3))/(3*5*...*(df-2)) c^(df-2)))   (df = 1: 2 theta / pi);
      df even: s * (1 + 1/2 c^2 + (1*3)/(2*4) c^4 + ... + (1*3*...*(df-3))/(2*4*...*(df-2)) c^(df-2))."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:
        term, total = math.cos(theta), 0.0  # the c^1 term; each next one: * c^2 * (2j) / (2j + 1)
        for j in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c2 * (2 * j) / (2 * j + 1)
        return 2 / math.pi * (theta + s * total)
    term, total = 1.0, 0.0  # the c^0 term; each next one: * c^2 * (2j - 1) / (2j)
    for j in range(1, df // 2 + 1):
        total += term
        term *= c2 * (2 * j - 1) / (2 * j)
    return s * total


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (t_{0.975, 2} = 4.303): `t_two_sided` inverted by
    bisection to 1e-12 relative (it is increasing in t), by symmetry for p < 0.5."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    target = 2 * p - 1  # P(|T| <= q) for the p-quantile q
    lo, hi = 0.0, 1.0
    while t_two_sided(hi, df) < target:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided(mid, df) < target else (lo, mid)
    return (lo + hi) / 2


def t_interval(xs: list[float], level: float = 0.95) -> tuple[float, float | None, float | None]:
    """Mean and the `level` Student-t interval of the mean over seeds: mean -+ t_{(1+level)/2, n-1} * sd / sqrt(n),
    sd the sample standard deviation (n - 1 in its denominator). The seeds are the independent replicates; with
    n = 3 the 95% half-width is 4.303 * sd / sqrt(3). (mean, None, None) for a single seed: no interval."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, None, None
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    half = t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return m, m - half, m + half


def fmt_ci(ci: tuple[float, float | None, float | None], sign: str = "") -> str:
    """`mean [lo, hi]` with three decimals (`sign` "+": signed), or the mean alone when there is no interval."""
    m, lo, hi = ci
    f = f"{{:{sign}.3f}}"
    return f"{f.format(m)} [{f.format(lo)}, {f.format(hi)}]" if lo is not None else f"{f.format(m)} (one seed)"


def bootstrap_ci(xs: list[float], n: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """Mean and 95% percentile-bootstrap interval of the mean, resampling seeds with replacement. (Over a handful of
    seeds it covers far less than 95%: the report uses `t_interval`.)"""
    rng = random.Random(seed)
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, m, m
    means = sorted(sum(rng.choice(xs) for _ in xs) / len(xs) for _ in range(n))
    return m, means[int(0.025 * n)], means[int(0.975 * n) - 1]


def paired_p(diffs: list[float]) -> float | None:
    """Two-sided p-value of the paired t-test that the mean of `diffs` (per-seed differences) is 0: P(|T| >= |t|),
    t = mean / (sd / sqrt(n)), n - 1 degrees of freedom. 1.0 when every difference is 0, None for one seed."""
    n = len(diffs)
    if n < 2:
        return None
    m = sum(diffs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in diffs) / (n - 1))
    if sd == 0:
        return 1.0 if m == 0 else 0.0
    return 1.0 - t_two_sided(m / (sd / math.sqrt(n)), n - 1)


def holm(pvalues: dict) -> dict:
    """Holm's step-down adjustment of a family of p-values (name -> p; None left out): the k-th smallest of m gets
    max over j <= k of min(1, (m - j + 1) p_(j)). Rejecting where the adjusted p < alpha keeps the chance of any false
    rejection in the family at most alpha, whatever the dependence between the comparisons."""
    ranked = sorted((p, name) for name, p in pvalues.items() if p is not None)
    m, out, running = len(ranked), {}, 0.0
    for k, (p, name) in enumerate(ranked):
        running = max(running, min(1.0, (m - k) * p))
        out[name] = running
    return out


def detectable(diffs: list[float], power: float = 0.8, level: float = 0.95) -> float | None:
    """The smallest true mean difference a paired t-test at `level` (two-sided) detects with probability `power`
    over n seeds with these differences' spread: (t_{(1+level)/2, n-1} + t_{power, n-1}) * sd / sqrt(n) (the usual
    approximation of the noncentral t; slightly under the exact value for few seeds). None for one seed."""
    n = len(diffs)
    if n < 2:
        return None
    m = sum(diffs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in diffs) / (n - 1))
    return (t_quantile((1 + level) / 2, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)


def fieller(num: list[float], den: list[float], level: float = 0.95) -> tuple[float | None, float | None, float | None]:
    """The ratio of two paired means, mean(num) / mean(den), with Fieller's `level` interval (per seed k: num_k, den_k,
    e.g. a method's and the control's gains over GRPO on seed k). With a = mean(num), b = mean(den), their variances
    v_aa, v_bb and covariance v_ab (of the means: over n seeds, divided by n), and t = t_{(1+level)/2, n-1}, the
    interval is the set of r with (a - r b)^2 <= t^2 (v_aa - 2 r v_ab + r^2 v_bb): the roots of
    (b^2 - t^2 v_bb) r^2 - 2 (a b - t^2 v_ab) r + (a^2 - t^2 v_aa) = 0. It is bounded only when the denominator's
    own interval excludes 0 (b^2 > t^2 v_bb); else (ratio, None, None): the share is not defined by the data."""
    n = len(num)
    if n < 2 or n != len(den):
        return None, None, None
    a, b = sum(num) / n, sum(den) / n
    v_aa = sum((x - a) ** 2 for x in num) / (n - 1) / n
    v_bb = sum((y - b) ** 2 for y in den) / (n - 1) / n
    v_ab = sum((x - a) * (y - b) for x, y in zip(num, den)) / (n - 1) / n
    ratio = a / b if b else None
    t2 = t_quantile((1 + level) / 2, n - 1) ** 2
    qa, qb, qc = b * b - t2 * v_bb, a * b - t2 * v_ab, a * a - t2 * v_aa
    if qa <= 0:
        return ratio, None, None
    root = math.sqrt(max(qb * qb - qa * qc, 0.0))
    return ratio, (qb - root) / qa, (qb + root) / qa


def mean_curve(by_seed: dict) -> list[tuple[int, float, float, float, float]]:
    """(step, mean generated tokens, mean accuracy, 95% low, 95% high: the t-interval over seeds, the mean itself for
    one seed) at the steps every seed evaluated."""
    steps = sorted(set.intersection(*({p[0] for p in pts} for pts in by_seed.values())))
    out = []
    for s in steps:
        acc = [p[2] for pts in by_seed.values() for p in pts if p[0] == s]
        tok = [p[1] for pts in by_seed.values() for p in pts if p[0] == s]
        m, lo, hi = t_interval(acc)
        out.append((s, sum(tok) / len(tok), m, m if lo is None else lo, m if hi is None else hi))
    return out


def first_reach(curve, target: float):
    """(step, tokens) of the first evaluation whose mean accuracy is >= target, or (None, None)."""
    return next(((s, t) for s, t, m, _, _ in curve if m >= target - 1e-9), (None, None))


def endpoint(points: list, last: int = 1) -> float:
    """A run's endpoint: the mean accuracy of its `last` evaluations (1: the final one); points: [(step, tokens,
    accuracy), ...]."""
    accs = [p[2] for p in points[-last:]]
    return sum(accs) / len(accs)


def versus_grpo(by_seed: dict, grpo: dict, last: int = 1) -> dict:
    """A method's final greedy accuracy over its seeds and against GRPO's on the same seeds (same seed: same held-out
    problems and first batches, so the paired difference is the sharper test):
      final            mean over its seeds of the final accuracy, with its 95% t-interval (final_lo, final_hi);
      n                the seeds both it and GRPO finished;
      diff             mean over those n seeds of (its final - GRPO's final), with the 95% paired t-interval (lo, hi):
                       the t-interval of the n per-seed differences;
      min_ratio        min over those seeds of (its final / GRPO's final): a collapse on one seed shows here even when
                       the mean hides it (seeds where GRPO's final is 0 are left out; None when none is left);
      evals_diff       mean over those n seeds of the mean, over the evaluations after step 0 that both made, of (its
                       accuracy - GRPO's), with its 95% paired t-interval (evals_lo, evals_hi): less hostage to one
                       evaluation than diff; evals_n: the seeds among those n that share such an evaluation with GRPO
                       (a seed evaluated at other steps than GRPO's is left out of evals_diff, not counted as 0).
    grpo: GRPO's curves by seed (seed -> [(step, tokens, accuracy), ...]). last > 1: "final" is each seed's endpoint,
    the mean of its last `last` evaluations, which one evaluation's jump cannot swing."""
    grpo_final = {k: endpoint(pts, last) for k, pts in grpo.items()}
    finals = [endpoint(pts, last) for pts in by_seed.values()]
    final, final_lo, final_hi = t_interval(finals)
    shared = sorted(k for k in by_seed if k in grpo_final)
    diffs = [endpoint(by_seed[k], last) - grpo_final[k] for k in shared]
    diff, lo, hi = t_interval(diffs) if diffs else (None, None, None)
    ratios = [endpoint(by_seed[k], last) / grpo_final[k] for k in shared if grpo_final[k] > 0]
    per_seed = []
    for k in shared:
        theirs = {step: acc for step, _, acc in grpo[k]}
        pairs = [acc - theirs[step] for step, _, acc in by_seed[k] if step > 0 and step in theirs]
        if pairs:
            per_seed.append(sum(pairs) / len(pairs))
    evals_diff, evals_lo, evals_hi = t_interval(per_seed) if per_seed else (None, None, None)
    return dict(
        n=len(shared),
        diff=diff,
        lo=lo,
        hi=hi,
        p=paired_p(diffs),
        mde80=detectable(diffs),
        final=final,
        final_lo=final_lo,
        final_hi=final_hi,
        seeds=len(finals),
        min_ratio=min(ratios) if ratios else None,
        evals_diff=evals_diff,
        evals_lo=evals_lo,
        evals_hi=evals_hi,
        evals_n=len(per_seed),
    )


def versus_control(by_seed: dict, grpo: dict, control: dict, last: int = 1) -> dict:
    """A method against the positive control (benchmarks/perfect_credit.py) on the seeds all three finished:
    vs_control  mean of (its final - the control's final), with the paired 95% t-interval (vs_control_lo, _hi);
    share       the share of the control's gain over GRPO that the method recovers, mean(its final - GRPO's) /
                mean(the control's final - GRPO's), with Fieller's 95% interval (share_lo, share_hi; None when the
                control's own gain is not shown: the share is then undefined); n_control: the seeds used.
    Finals are endpoints (versus_grpo's `last`)."""
    final = lambda curves, k: endpoint(curves[k], last)  # noqa: E731
    shared = sorted(k for k in by_seed if k in grpo and k in control)
    mine = [final(by_seed, k) - final(grpo, k) for k in shared]
    ctrl = [final(control, k) - final(grpo, k) for k in shared]
    vs = t_interval([final(by_seed, k) - final(control, k) for k in shared]) if shared else (None, None, None)
    share = fieller(mine, ctrl)
    return dict(n_control=len(shared), vs_control=vs[0], vs_control_lo=vs[1], vs_control_hi=vs[2],
                share=share[0], share_lo=share[1], share_hi=share[2])  # fmt: skip


def commits_of(setting: str, results: Path, curves: dict, quiet: bool | None = False) -> dict:
    """method -> the commits its seeds in `curves` were run at (each seed's .run.json; older results: the method's
    meta.json, which every `run` call rewrote, so it names the last one; a file that is no JSON: 'unknown (file)')."""
    out = {}
    for name, files in seed_files(setting, results, quiet=None).items():
        meta = results / setting / name / "meta.json"
        fallback = read_json(meta, quiet).get("commit", f"unknown ({meta.name})") if meta.exists() else "unknown"
        for seed, f in files.items():
            if seed not in curves.get(name, {}):
                continue
            run = run_path(f)
            commit = read_json(run, quiet).get("commit", f"unknown ({run.name})") if run.exists() else None
            out.setdefault(name, set()).add(str(commit) if commit is not None else f"{fallback} (meta.json)")
    return out


def cmd_report(a) -> None:
    curves = load(a.setting, Path(a.results), quiet=a.json)
    default = Path(a.results).resolve() == RESULTS.resolve()
    a.img = a.img or str(ROOT / "docs" / "img" if default else Path(a.results) / a.setting)
    if not curves:
        sys.exit(
            f"no results under {Path(a.results) / a.setting}: run `learning_curves.py run --setting {a.setting}` first"
        )
    means = {m: mean_curve(by_seed) for m, by_seed in curves.items()}
    base = means.get("grpo")
    target = base[-1][2] if base else None
    final_step = base[-1][0] if base else None
    grpo = curves.get("grpo", {})
    grpo_final = {k: pts[-1][2] for k, pts in grpo.items()}  # GRPO's final accuracy, by seed
    order = sorted(means, key=lambda m: ("@" in m, m != "grpo", m))  # GRPO, the defaults, then sweeps
    for m in order:
        ends = sorted({pts[-1][0] for pts in curves[m].values()})
        if len(ends) > 1:
            sys.exit(f"{m}: its seeds end at different steps {ends}; rerun or remove the short ones")
    commits = commits_of(a.setting, Path(a.results), curves, quiet=a.json)
    every = sorted(set().union(*commits.values())) if commits else []
    if len(every) > 1 and not a.pool_commits:
        why = "pooling them compares code as well as methods: rerun at one commit, or pass --pool-commits"
        sys.exit(f"{a.setting}: its runs come from {len(every)} commits ({', '.join(every)}); {why}")
    control = curves.get("control")
    family = [m for m in order if m != "grpo"]  # the comparisons with GRPO in this table: Holm's family
    rows = {m: versus_grpo(curves[m], grpo, a.last) for m in order}
    adjusted = holm({m: rows[m]["p"] for m in family})
    for m in order:
        rows[m] |= {"p_holm": adjusted.get(m), "family": len(family), "commits": sorted(commits.get(m, []))}
        if control is not None and m not in ("grpo", "control"):
            rows[m] |= versus_control(curves[m], grpo, control, a.last)
    if a.json:  # one JSON line per method, nothing written
        for m in order:
            print(json.dumps({"method": m, **rows[m]}))
        return
    lines = [
        f"Setting `{a.setting}` ({' '.join(SETTINGS.get(a.setting, [])) or 'defaults'}); greedy pass@1 on 200 "
        "held-out problems; mean over seeds with its 95% Student-t interval over seeds (n - 1 degrees of freedom); "
        "the difference from GRPO is paired by seed (the seeds both finished: n paired) with the t-interval of the "
        "per-seed differences; min ratio: the lowest, over those seeds, of the method's final / GRPO's final on the "
        "same seed (a collapse on one seed shows there); mean over evals: over every evaluation, step 0 included; "
        "evals − GRPO: the per-seed mean, over the evaluations after step 0, of the method's accuracy minus GRPO's, "
        "paired by seed (less hostage to one evaluation than the final).",
        "",
        f"p: the paired t-test's, two-sided; Holm: adjusted over this table's family of {len(family)} comparisons with "
        "GRPO; detects: the smallest true difference this many seeds detect 80% of the time at 95% (two-sided), "
        "from the differences' spread"
        + (
            "; − control and the share of the control's gain (Fieller's 95% "
            "interval; – where the control's own gain is not shown): against benchmarks/perfect_credit.py on the "
            "same seeds"
            if control is not None
            else ""
        )
        + f". Commits: {', '.join(every)}."
        + (
            f' Endpoint (every "final" here): each seed\'s mean over its last {a.last} evaluations.'
            if a.last > 1
            else ""
        ),
        "",
        "| method | seeds | step 0 | final (step) | final, 95% t-interval | n paired "
        "| final − GRPO, paired 95% t-interval | p (Holm) | detects (80%) | min ratio to GRPO "
        "| mean over evals, 95% t-interval | evals − GRPO, paired 95% t-interval "
        + ("| final − control, paired 95% t-interval | share of the control's gain, 95% " if control else "")
        + "| steps to GRPO's final (same seeds) | speed-up | tokens to it | tokens / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if control else ""),
    ]
    for m in order:
        curve, by_seed = means[m], curves[m]
        v = rows[m]
        d = fmt_ci((v["diff"], v["lo"], v["hi"]), "+") if v["n"] else "–"
        pv = f"{v['p']:.3f} ({v['p_holm']:.3f})" if v.get("p_holm") is not None else "–"
        mde = f"{v['mde80']:.3f}" if v.get("mde80") is not None and m != "grpo" else "–"
        vc = ""
        if control is not None:
            c = fmt_ci((v["vs_control"], v["vs_control_lo"], v["vs_control_hi"]), "+") if v.get("n_control") else "–"
            sh = "–"
            if v.get("share") is not None:
                sh = f"{v['share']:.2f}" + (f" [{v['share_lo']:.2f}, {v['share_hi']:.2f}]" if v["share_lo"] is not None
                                            else " [undefined]")  # fmt: skip
            vc = f"{c} | {sh} | "
        ev = fmt_ci((v["evals_diff"], v["evals_lo"], v["evals_hi"]), "+") if v["evals_diff"] is not None else "–"
        ev += f" (n = {v['evals_n']})" if v["evals_n"] not in (0, v["n"]) else ""  # seeds with no shared evaluation
        ratio = f"{v['min_ratio']:.2f}" if v["min_ratio"] is not None else "–"
        auc = t_interval([sum(p[2] for p in pts) / len(pts) for pts in by_seed.values()])  # mean over all evaluations
        # GRPO's final over the same seeds (a 2-seed sweep is measured against those 2 seeds of GRPO)
        shared = [k for k in by_seed if k in grpo_final]
        same = sum(grpo_final[k] for k in shared) / len(shared) if shared else target
        s, tok = first_reach(curve, same) if target is not None else (None, None)
        speed = f"{final_step / s:.2f}x" if s else ("–" if s is None else "at step 0")
        tok_step = curve[-1][1] / curve[-1][0] if curve[-1][0] else 0
        final = fmt_ci((v["final"], v["final_lo"], v["final_hi"]))
        lines.append(
            f"| {m} | {len(by_seed)} | {curve[0][2]:.3f} | {v['final']:.3f} ({curve[-1][0]}) | {final} | {v['n']} | "
            f"{d} | {pv} | {mde} | {ratio} | {fmt_ci(auc)} | {ev} | {vc}"
            f"{s if s is not None else 'not reached'} | {speed} | {f'{tok / 1e3:.0f}k' if tok is not None else '–'} | "
            f"{tok_step:.0f} |"
        )
    lines += ["", "What the intervals exclude (95%, paired by seed; the upper bound of each difference from GRPO):", ""]
    for m in family:
        v = rows[m]
        if v["hi"] is None:
            continue
        if v["lo"] > 0:
            lines.append(f"- {m}: above GRPO by at least {v['lo']:+.3f} (a gain above {v['hi']:+.3f} is excluded)")
        elif v["hi"] < 0:
            lines.append(f"- {m}: below GRPO by at least {-v['hi']:.3f} (a loss beyond {v['lo']:+.3f} is excluded)")
        else:
            lines.append(f"- {m}: no difference shown; a gain above {v['hi']:+.3f} and a loss beyond {v['lo']:+.3f} "
                         f"are excluded (it detects {v['mde80']:.3f} 80% of the time)")  # fmt: skip
    if a.contrast:
        lines += ["", *contrast_lines(curves, a.contrast, a.last)]
    table = "\n".join(lines)
    print(table)
    out = Path(a.results) / a.setting
    where = "" if default else f" --results {os.path.relpath(Path(a.results).resolve(), ROOT)}"
    where += " --pool-commits" if a.pool_commits else ""
    where += f" --last {a.last}" if a.last != 1 else ""
    where += f" --contrast {' '.join(a.contrast)}" if a.contrast else ""
    command = f"python benchmarks/learning_curves.py report --setting {a.setting}{where}"
    (out / "report.md").write_text(f"`{command}`\n\n{table}\n")
    main = {m: c for m, c in means.items() if "@" not in m}  # the methods at their defaults
    plot(
        main,
        Path(a.img) / f"learning_curves_{a.setting}.png",
        f"arith '{a.setting}', tiny model: mean of {max(len(curves[m]) for m in main)} seeds, 95% t band",
    )
    sweeps = {m: c for m, c in means.items() if "@" in m}  # --tag runs: each beside its method at the defaults
    for base in sorted({m.split("@")[0] for m in sweeps}):  # one plot per swept method
        plot(
            {m: c for m, c in means.items() if m.split("@")[0] == base or m == "grpo"},
            Path(a.img) / f"learning_curves_{a.setting}_{base}_sweeps.png",
            f"arith '{a.setting}': {base} flag sweeps ({base}@tag) beside its defaults and GRPO; mean over their seeds",
        )
    mechanisms(a, main, out)
    print(f"report: {out / 'report.md'}")


def contrasts(curves: dict, pairs: list[str], last: int = 1) -> list[dict]:
    """Planned comparisons "A-B" (method names): per pair, the mean over the seeds both finished of A's endpoint minus
    B's (versus_grpo's `last`), its paired 95% t-interval, p (paired_p), the smallest difference it detects 80% of the
    time, and p Holm-adjusted over the listed pairs (their own family)."""
    out = []
    for pair in pairs:
        cuts = [(pair[:i], pair[i + 1 :]) for i, c in enumerate(pair) if c == "-"]  # a tag may hold a "-" too
        found = [(a, b) for a, b in cuts if a in curves and b in curves]
        if not found:
            sys.exit(f"--contrast {pair}: not two methods with finished runs, A-B (have: {', '.join(sorted(curves))})")
        a, b = found[0]
        shared = sorted(k for k in curves[a] if k in curves[b])
        diffs = [endpoint(curves[a][k], last) - endpoint(curves[b][k], last) for k in shared]
        m, lo, hi = t_interval(diffs) if diffs else (None, None, None)
        out.append(dict(pair=pair, a=a, b=b, n=len(diffs), diff=m, lo=lo, hi=hi, p=paired_p(diffs),
                        mde80=detectable(diffs)))  # fmt: skip
    adjusted = holm({c["pair"]: c["p"] for c in out})
    return [c | {"p_holm": adjusted.get(c["pair"])} for c in out]


def contrast_lines(curves: dict, pairs: list[str], last: int = 1) -> list[str]:
    """The planned comparisons' table (contrasts), markdown lines."""
    lines = [f"Planned comparisons (paired by seed; Holm over these {len(pairs)}):", ""]
    lines += ["| comparison | n paired | difference, paired 95% t-interval | p (Holm) | detects (80%) |"]
    lines += ["|---|---|---|---|---|"]
    for c in contrasts(curves, pairs, last):
        d = fmt_ci((c["diff"], c["lo"], c["hi"]), "+") if c["n"] else "–"
        pv = f"{c['p']:.3f} ({c['p_holm']:.3f})" if c["p"] is not None else "–"
        mde = f"{c['mde80']:.3f}" if c["mde80"] is not None else "–"
        lines.append(f"| {c['a']} − {c['b']} | {c['n']} | {d} | {pv} | {mde} |")
    return lines


MECHANISMS = {  # metric -> what it shows (docs/benchmarks.md explains each method's result with them)
    "frac_groups_unsolved": "groups with no success (GRPO learns nothing from them)",
    "frac_reward_zero_std": "groups whose rewards are all equal",
    "reset/correction_rate": "SRPO: reset suffixes that succeed where the parent failed",
    "reset/suffix_pass_at_k": "SRPO: reset groups with at least one successful suffix",
    "reset/fallback_share": "SRPO: prompts with no failed parent (the fallback group)",
    "ep/zero_var_adv_share": "EP-GRPO: share of the update's \\|A\\| from all-equal groups",
    "ep/zero_var_groups_with_grad": "EP-GRPO: all-equal groups that still get a gradient",
    "sc/groups_none": "SC-GRPO: solve-none groups (the diversity bonus)",
    "sc/groups_partial": "SC-GRPO: partial-solve groups (f-weighted)",
    "sc/weight_mean": "SC-GRPO: mean token weight f",
}


def mechanisms(a, methods, out: Path) -> None:
    """The logged metrics that explain each result, first and last 10 steps (mean over seeds), appended to the report,
    and the share of unsolved groups over training, per method, as a plot beside the accuracy plot."""
    per = {}  # method -> metric -> step -> [values over seeds]
    files = seed_files(a.setting, Path(a.results), quiet=None)
    for m in methods:
        for f in files.get(m, {}).values():
            rows = seed_rows(f, quiet=None)
            if rows is None:  # left out of the results table too (said there)
                continue
            for r in rows:
                for k in MECHANISMS:
                    if k in r and r["step"] > 0 and type(r[k]) in (int, float) and math.isfinite(r[k]):
                        per.setdefault(m, {}).setdefault(k, {}).setdefault(r["step"], []).append(r[k])
    if not per:  # runs from before these metrics were logged
        return
    lines = ["", "What explains it (the logged metrics, mean over seeds):", ""]
    lines += ["| method | metric | steps 1-10 | last 10 steps | what it shows |", "|---|---|---|---|---|"]
    for m in sorted(per, key=lambda x: x != "grpo"):
        for k, by_step in per[m].items():
            steps = sorted(by_step)
            avg = lambda ss: sum(sum(by_step[s]) / len(by_step[s]) for s in ss) / len(ss)  # noqa: E731
            lines.append(f"| {m} | `{k}` | {avg(steps[:10]):.3f} | {avg(steps[-10:]):.3f} | {MECHANISMS[k]} |")
    with (out / "report.md").open("a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    palette = iter(plt.get_cmap("tab10").colors)
    for m in sorted(per, key=lambda x: x != "grpo"):
        by_step = per[m].get("frac_groups_unsolved", {})
        steps = sorted(by_step)
        if not steps:
            continue
        y = [sum(by_step[s]) / len(by_step[s]) for s in steps]
        k = 10  # a 10-step moving average
        smooth = [sum(y[max(0, i - k + 1) : i + 1]) / len(y[max(0, i - k + 1) : i + 1]) for i in range(len(y))]
        ax.plot(steps, smooth, label=m, color="black" if m == "grpo" else next(palette))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("share of groups with no success (10-step mean)")
    ax.set_title(f"arith '{a.setting}': where GRPO starves (SRPO: its own trained groups)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(a.img) / f"learning_curves_{a.setting}_unsolved.png"
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def plot(means: dict, path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -r benchmarks/requirements.txt)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    palette = plt.get_cmap("tab20").colors  # 20 distinct colours: a sweep plot has up to ~12 curves; GRPO is black
    others = iter(palette[0::2] + palette[1::2])
    for m, curve in means.items():
        step, tok, mean, lo, hi = (list(x) for x in zip(*curve))
        color = "black" if m == "grpo" else next(others)
        for ax, x in zip(axes, (step, [t / 1e3 for t in tok])):
            ax.plot(x, mean, marker="o", ms=2.5, label=m, color=color)
            ax.fill_between(x, lo, hi, alpha=0.15, color=color)
    axes[0].set_xlabel("optimizer step")
    axes[1].set_xlabel("generated tokens (thousands; SRPO's include localization and parent search)")
    for ax in axes:
        ax.set_ylabel("eval accuracy (greedy pass@1)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train the (method, seed) runs that are not complete yet")
    r.add_argument("--setting", choices=list(SETTINGS), default="headroom")
    r.add_argument("--methods", nargs="*", help=f"default: all of {list(METHODS)}")
    r.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    r.add_argument("--steps", type=int, default=150)
    r.add_argument("--eval-every", type=int, default=10)
    r.add_argument("--extra", default="", help="extra flags for every script, one string (with --tag)")
    r.add_argument("--tag", default="", help="results go to <method>@<tag>/ (for sweeps with --extra)")
    r.add_argument("--workers", type=int, default=1, help="runs at a time")
    r.add_argument("--threads", type=int, default=1, help="torch threads per run (results depend on it)")
    r.add_argument(
        "--log-credit",
        type=int,
        default=0,
        help="also record N rows' per-token credit at every evaluation step (seed<k>.credit.jsonl.gz; the training is "
        "the same: the credit is read from the loss's gradient); benchmarks/credit_accuracy.py reads them",
    )
    r.add_argument("--results", default=str(RESULTS))
    f = sub.add_parser("flags", help="print a setting's script flags on one line")
    f.add_argument("--setting", choices=list(SETTINGS), required=True)
    p = sub.add_parser("report", help="table and plots from the results")
    p.add_argument("--setting", default="headroom")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument(
        "--img",
        default=None,
        help="where the plots go (default: docs/img for the default --results, else beside report.md, so a second "
        "results folder never overwrites the docs' figures)",
    )
    p.add_argument("--pool-commits", action="store_true", help="report runs made at different commits together")
    p.add_argument("--last", type=int, default=1, help="each seed's endpoint: the mean of its last N evaluations")
    p.add_argument("--contrast", nargs="*", default=[], help="planned comparisons A-B (e.g. control-grpo "
                   "control-placebo): paired differences of the endpoints, p and Holm over them")  # fmt: skip
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON line per method (versus_grpo's fields, p, p_holm, mde80, family, commits; with a control: "
        "versus_control's vs_control and share, each with _lo/_hi) and write nothing",
    )
    a = ap.parse_args()
    if a.cmd == "run" and a.extra and not a.tag:
        sys.exit("--extra changes the runs: give them a --tag so they do not mix with the defaults")
    if a.cmd == "flags":
        print(" ".join(SETTINGS[a.setting]))
    else:
        cmd_run(a) if a.cmd == "run" else cmd_report(a)


if __name__ == "__main__":
    main()
