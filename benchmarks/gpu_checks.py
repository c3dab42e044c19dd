r"""Benchmark and check for a GPU host: every script in bf16 without a non-finite value, and each one's peak memory and
step time on a real-shaped model, relative to grpo.py.

Part 1: every script (and grpo.py / sc_grpo.py under --lora-rank 16) x seeds 1-3 x --steps (20) steps on the bundled
tiny model in bfloat16, --jobs of them at a time on the one GPU (a NaN or inf loss or gradient norm stops a script with
exit code 1: the run fails). Part 2: every script --big-steps (8) steps on a random-init Qwen2.5-1.5B-shaped model (the
real vocabulary; built by gpu_vs_trl.build_model) with gradient checkpointing: median s/step over the steps after
the first --drop (2; the first steps are warm-up and varied 4-17 s), peak GPU memory (memory/peak_gb), and the
ratio of each script's step time to grpo.py's (targets: SC-GRPO <= 1.6, GRPO-lambda <= 1.05, EP-GRPO <= 1.4,
SRPO <= 2.0). --deadline-s skips the runs that would start after it, so a short device lease still returns a table.
--engines runs part 2 under each rollout engine (static: the project's decode loop with CUDA graphs; hf: transformers'
generate) and reports generated tokens/s beside the bandwidth bound (a decode step reads the weights once: batch rows
/ (weight bytes / HBM bandwidth)) and the update's FLOP/s (8 x parameters x trained tokens, with recomputation) beside
the card's bf16 dense peak. Writes benchmarks/out/gpu_checks.json (after every run) and prints a markdown table.

    python benchmarks/gpu_checks.py                                   # on a GPU host, both parts
    python benchmarks/gpu_checks.py --parts big --big-steps 8 --big-new-tokens 64   # part 2 alone, shorter
    python benchmarks/gpu_checks.py --parts big --big-scripts grpo grpo_lora --engines static hf --big-new-tokens 512
    python benchmarks/gpu_checks.py --device cpu --dtype float32 --steps 2 --seeds 1 --shape tiny \
        --big-new-tokens 8                                            # CPU smoke
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # HBM bytes/s by card name (SXM parts)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s
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
    "grpo_lora": ["grpo.py", "--lora-rank", "16"],
    "sc_grpo_lora": ["sc_grpo.py", "--lora-rank", "16"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 is the check; a CPU smoke run is faster in float32")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--shape", default="1.5b")
    ap.add_argument("--big-steps", type=int, default=8)
    ap.add_argument("--drop", type=int, default=2, help="warm-up steps left out of the median s/step")
    ap.add_argument("--jobs", type=int, default=1, help="part 1 runs at a time (tiny model: several fit one GPU)")
    ap.add_argument("--big-scripts", nargs="+", default=None, choices=list(SCRIPTS), help="part 2 (default: --scripts)")
    ap.add_argument(
        "--model",
        default=None,
        help="part 2 on this saved model instead of building --shape's (--shape still labels it)",
    )
    ap.add_argument("--run-timeout", type=float, default=None, help="kill a run after this many seconds")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    ap.add_argument("--big-new-tokens", type=int, default=256)
    ap.add_argument("--engines", nargs="+", default=["static"], choices=["static", "hf"], help="part 2's engines")
    ap.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    ap.add_argument("--parts", nargs="+", default=["finite", "big"], choices=["finite", "big"], help="which parts")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "gpu_checks.json"))
    a = ap.parse_args()
    import torch

    t0 = time.perf_counter()
    late = lambda: a.deadline_s is not None and time.perf_counter() - t0 > a.deadline_s  # noqa: E731
    device = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "CPU"
    res = {"device": device, "torch": torch.__version__, "finite": {}, "big": {}, "skipped": []}
    save = lambda: Path(a.out).write_text(json.dumps(res, indent=1))  # noqa: E731
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    common = ["--device", a.device, "--dtype", a.dtype, "--eval-every", "0", "--num-eval", "8"]

    def check_finite(job: tuple[str, int]) -> None:
        name, seed = job
        if late():
            res["skipped"].append(f"finite {name}/{seed}")
            return
        run = run_script(
            [*SCRIPTS[name], *common, "--seed", str(seed), "--total-steps", str(a.steps)], timeout=a.run_timeout
        )
        res["finite"][f"{name}/{seed}"] = ok = run.ok and len(run.rows) == a.steps + 1
        print(f"{name} seed {seed}: {'ok' if ok else 'FAILED ' + run.tail(1500)}", flush=True)
        save()

    jobs = [(name, seed) for name in a.scripts for seed in a.seeds] if "finite" in a.parts else []
    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        list(pool.map(check_finite, jobs))
    big_scripts = a.big_scripts or a.scripts
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or (build_model(a.shape, Path(tmp) / a.shape, 151936) if "big" in a.parts else None)
        weight_bytes = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) if model else 0
        card = next((k for k in BANDWIDTH if k in device), None)
        runs = [(name, e) for name in (big_scripts if "big" in a.parts else []) for e in a.engines]
        for name, engine in runs:
            key = name if engine == "static" else f"{name}@{engine}"
            if late():
                res["skipped"].append(f"big {key}")
                print(f"{key} on {a.shape}: skipped (past --deadline-s)", flush=True)
                continue
            run = run_script(
                [
                    *SCRIPTS[name],
                    *common,
                    "--model",
                    str(model),
                    "--engine",
                    engine,
                    "--total-steps",
                    str(a.big_steps),
                    "--max-new-tokens",
                    str(a.big_new_tokens),
                    "--gradient-checkpointing",
                    "--learning-rate",
                    "1e-6",
                    "--micro-batch-size",
                    "8",
                ],
                timeout=a.run_timeout,
            )
            steps = run.steps
            if not run.ok or not steps:
                print(f"{key} on {a.shape}: FAILED {run.tail(1500)}", flush=True)
                continue
            times = [r["time/step"] for r in steps]
            timed = steps[a.drop :] or steps[-1:]  # the steps after the warm-up
            kept = [r["time/step"] for r in timed]
            t = statistics.median(kept)
            peak = max(r.get("memory/peak_gb", 0.0) for r in steps)
            parts = {k: statistics.median(r[k] for r in timed) for k in steps[0] if "time/" in k}
            rest = [r["time/step"] - r.get("time/generation", 0.0) for r in timed]  # log-probs, update, the rest
            parts["time/not_generation"] = statistics.median(rest)
            made = statistics.median(r.get("sampling/generated_tokens", r["num_tokens"]) for r in timed)
            speed = dict(generated_tokens=made, tokens_per_s=made / parts.get("time/generation", float("nan")))
            if card and weight_bytes:  # 64 rows decode together: each step reads the weights once
                speed["bound_tokens_per_s"] = 64 * BANDWIDTH[card] / weight_bytes
                trained = statistics.median(r["num_tokens"] for r in timed)  # completion tokens (prompts add more)
                flop = 8 * (weight_bytes / 2) * trained
                speed["update_tflops"] = flop / parts.get("time/update", float("nan")) / 1e12
                speed["peak_tflops"] = PEAK_BF16[card] / 1e12
            res["big"][key] = dict(s_per_step=t, peak_gb=peak, step_times=times, timed_steps=len(kept), parts=parts)
            res["big"][key] |= speed
            print(
                f"{key} on {a.shape}: {t:.2f} s/step over {len(kept)} steps ({', '.join(f'{x:.2f}' for x in times)}),"
                f" peak {peak:.1f} GB, {speed['tokens_per_s']:.0f} generated tokens/s",
                flush=True,
            )
            save()
    base = res["big"].get("grpo", {}).get("s_per_step")
    lines = [
        f"{device}; {a.shape}-shaped random-init model, {a.dtype}, gradient checkpointing,"
        f" {a.big_new_tokens} new tokens, median of steps {a.drop + 1}-{a.big_steps}",
        "",
        "| script | s/step | generation s | the rest s | x grpo.py | peak GB | bf16 runs finite |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = [n if e == "static" else f"{n}@{e}" for n in dict.fromkeys([*a.scripts, *big_scripts]) for e in a.engines]
    for name in keys:
        b = res["big"].get(name)
        finite = sum(res["finite"].get(f"{name}/{s}", False) for s in a.seeds)
        finite = f"{finite}/{len(a.seeds)}" if "finite" in a.parts else "not run"
        if not (b and base):
            lines.append(f"| {name} | – | – | – | – | – | {finite} |")
            continue
        gen = b["parts"].get("time/generation", float("nan"))
        rest = b["parts"].get("time/not_generation", float("nan"))  # the median of each step's own remainder
        ratio = b["s_per_step"] / base
        lines.append(
            f"| {name} | {b['s_per_step']:.2f} | {gen:.2f} | {rest:.2f} | {ratio:.2f} | {b['peak_gb']:.1f} | {finite} |"
        )
    lines += ["", "| run | generated tokens/s | bound (weights read once a step) | update TFLOP/s | card peak |"]
    lines += ["|---|---|---|---|---|"]
    for name, b in res["big"].items():
        bound, tf, peak_tf = (b.get(k, float("nan")) for k in ("bound_tokens_per_s", "update_tflops", "peak_tflops"))
        lines.append(f"| {name} | {b['tokens_per_s']:.0f} | {bound:.0f} | {tf:.0f} | {peak_tf:.0f} |")
    print("\n".join(lines))
    res["table"] = lines
    if res["skipped"]:
        print("skipped (past --deadline-s):", ", ".join(res["skipped"]))
    save()
    if not all(res["finite"].values()):
        sys.exit("a bf16 run stopped (a non-finite value or an error): see above")


if __name__ == "__main__":
    main()
