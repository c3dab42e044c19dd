r"""Benchmark and check for a GPU host: every script in bf16 without a non-finite value, and each one's peak memory and
step time on a real-shaped model, relative to grpo.py.

Part 1: every script x seeds 1-3 x --steps (20) steps on the bundled tiny model in bfloat16 (a NaN or inf loss or
gradient norm stops a script with exit code 1: the run fails). Part 2: every script --big-steps (3) steps on a
random-init Qwen2.5-1.5B-shaped model (the real vocabulary; built by gpu_vs_trl.build_model) with gradient
checkpointing: median s/step (the first step dropped), peak GPU memory (memory/peak_gb), and the ratio of each
script's step time to grpo.py's (targets: SC-GRPO <= 1.6, GRPO-lambda <= 1.05, EP-GRPO <= 1.4, SRPO <= 2.0).
Writes benchmarks/out/gpu_checks.json and prints a markdown table.

    python benchmarks/gpu_checks.py                                   # on a GPU host, both parts
    python benchmarks/gpu_checks.py --parts big --big-steps 2 --big-new-tokens 64   # part 2 alone, shorter
    python benchmarks/gpu_checks.py --device cpu --dtype float32 --steps 2 --seeds 1 --shape tiny \
        --big-new-tokens 8                                            # CPU smoke
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_vs_trl import build_model  # noqa: E402
from harness import run_script  # noqa: E402

SCRIPTS = {
    "grpo": ["grpo.py"],
    "sc_grpo": ["sc_grpo.py"],
    "grpo_lambda": ["grpo_lambda.py"],
    "ep_grpo": ["ep_grpo.py"],
    "srpo": ["srpo.py"],
    "rrpo": ["srpo.py", "--reset", "random"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 is the check; a CPU smoke run is faster in float32")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--shape", default="1.5b")
    ap.add_argument("--big-steps", type=int, default=3)
    ap.add_argument("--big-new-tokens", type=int, default=256)
    ap.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    ap.add_argument("--parts", nargs="+", default=["finite", "big"], choices=["finite", "big"], help="which parts")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "gpu_checks.json"))
    a = ap.parse_args()
    import torch

    device = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "CPU"
    res = {"device": device, "finite": {}, "big": {}}
    common = ["--device", a.device, "--dtype", a.dtype, "--eval-every", "0", "--num-eval", "8"]
    for name in a.scripts if "finite" in a.parts else []:
        for seed in a.seeds:
            run = run_script([*SCRIPTS[name], *common, "--seed", str(seed), "--total-steps", str(a.steps)])
            res["finite"][f"{name}/{seed}"] = ok = run.ok and len(run.rows) == a.steps + 1
            print(f"{name} seed {seed}: {'ok' if ok else 'FAILED ' + run.tail(1500)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(a.shape, Path(tmp) / a.shape, 151936) if "big" in a.parts else None
        for name in a.scripts if "big" in a.parts else []:
            run = run_script(
                [
                    *SCRIPTS[name],
                    *common,
                    "--model",
                    str(model),
                    "--total-steps",
                    str(a.big_steps),
                    "--max-new-tokens",
                    str(a.big_new_tokens),
                    "--gradient-checkpointing",
                    "--learning-rate",
                    "1e-6",
                    "--micro-batch-size",
                    "8",
                ]
            )
            steps = run.steps
            if not run.ok or not steps:
                print(f"{name} on {a.shape}: FAILED {run.tail(1500)}", flush=True)
                continue
            t = statistics.median(r["time/step"] for r in (steps[1:] or steps))
            res["big"][name] = dict(s_per_step=t, peak_gb=max(r.get("memory/peak_gb", 0.0) for r in steps))
            print(f"{name} on {a.shape}: {t:.2f} s/step, peak {res['big'][name]['peak_gb']:.1f} GB", flush=True)
    base = res["big"].get("grpo", {}).get("s_per_step")
    lines = [
        f"{device}; {a.shape}-shaped random-init model, bf16, gradient checkpointing, {a.big_new_tokens} new tokens",
        "",
        "| script | s/step | x grpo.py | peak GB | bf16 runs without a non-finite value |",
        "|---|---|---|---|---|",
    ]
    for name in a.scripts:
        b = res["big"].get(name)
        finite = sum(res["finite"].get(f"{name}/{s}", False) for s in a.seeds)
        lines.append(
            f"| {name} | {b['s_per_step']:.2f} | {b['s_per_step'] / base:.2f} | {b['peak_gb']:.1f} | "
            f"{finite}/{len(a.seeds)} |"
            if b and base
            else f"| {name} | – | – | – | {finite}/{len(a.seeds)} |"
        )
    print("\n".join(lines))
    res["table"] = lines
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    if not all(res["finite"].values()):
        sys.exit("a bf16 run stopped (a non-finite value or an error): see above")


if __name__ == "__main__":
    main()
