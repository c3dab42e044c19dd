"""Seconds per step: grpo.py against TRL's GRPOTrainer, same tiny model and the same work per step.

Both use the bundled model on the built-in arith task, 8 prompts x G=8 completions per step, at most 48 new
tokens, temperature 1.0 (top-p 1, top-k off), Hugging Face generate, beta 0, one pass per batch (mu = 1),
the original GRPO loss (seq-mean-token-mean; TRL's loss_type="grpo"), each library's default micro-batching.
They run in the same invocation, alternating (--rounds rounds of --steps steps each, each run a fresh
process); the first step of every run is warm-up and dropped. Per-step time: grpo.py's time/step
(generation + log-probs + update); TRL's on_step_begin -> on_step_end (its generation happens inside the
step). Peak memory: each process's peak RSS. Needs trl: pip install -r benchmarks/requirements.txt.

    python benchmarks/speed_vs_trl.py [--steps 6] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from harness import run_script

ROOT = Path(__file__).resolve().parent.parent
PROMPTS, G, MAX_NEW, LR = 8, 8, 48, 1e-5

TRL = r"""
import json, sys, time
sys.path.insert(0, ".")
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
import common
from rlvr_utils.core import models, tasks

torch.manual_seed({seed})
tok = models.load_tokenizer(common.DEFAULT_MODEL)
model = AutoModelForCausalLM.from_pretrained(common.DEFAULT_MODEL)
task = tasks.load_task("arith", tok, seed={seed}, num_eval=8)
data = Dataset.from_list([dict(prompt=e.prompt, gold=e.gold) for e in task.train[:2000]])

def reward(prompts, completions, gold, **kw):
    return [tasks.arith_reward(c, g) for c, g in zip(completions, gold)]

times = []
class Clock(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        times.append(time.perf_counter() - self.t0)

cfg = GRPOConfig(output_dir=sys.argv[sys.argv.index("--output-dir") + 1], per_device_train_batch_size={prompts} * {G},
                 num_generations={G}, generation_batch_size={prompts} * {G}, max_completion_length={max_new},
                 temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, loss_type="grpo",
                 scale_rewards="group", learning_rate={lr}, max_steps={steps}, logging_steps=1, report_to=[],
                 save_strategy="no", use_cpu=True, bf16=False, seed={seed}, dataloader_num_workers=0, disable_tqdm=True)
trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                      callbacks=[Clock()])
trainer.train()
print("RESULT", json.dumps(dict(step_seconds=times)))
"""


def run(kind: str, steps: int, seed: int, threads: int) -> dict:
    """One run in a fresh process: its step times (s) and its own peak RSS (MB)."""
    if kind == "ours":
        flags = ["--total-steps", str(steps), "--eval-every", "0", "--num-eval", "8", "--seed", str(seed)]
        flags += ["--prompts-per-step", str(PROMPTS), "--num-generations", str(G), "--max-new-tokens", str(MAX_NEW)]
        res = run_script(["grpo.py", *flags, "--learning-rate", str(LR)], threads=threads).check(kind)
        return dict(step_seconds=[r["time/step"] for r in res.steps], maxrss_mb=res.peak_rss_mb)
    code = TRL.format(steps=steps, prompts=PROMPTS, G=G, max_new=MAX_NEW, lr=LR, seed=seed)
    res = run_script(["-c", code], threads=threads).check(kind)
    out = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT"))[7:])
    return dict(step_seconds=out["step_seconds"], maxrss_mb=res.peak_rss_mb)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    times, rss = {"ours": [], "trl": []}, {"ours": [], "trl": []}
    for r in range(a.rounds):
        for kind in ("ours", "trl"):
            res = run(kind, a.steps, seed=r + 1, threads=a.threads)
            times[kind] += res["step_seconds"][1:]  # the first step is warm-up
            rss[kind].append(res["maxrss_mb"])
            print(
                kind,
                f"round {r + 1}:",
                " ".join(f"{t:.2f}" for t in res["step_seconds"]),
                f"s/step, peak RSS {res['maxrss_mb']:.0f} MB",
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in times.items()}
    out = dict(
        steps=a.steps,
        rounds=a.rounds,
        threads=a.threads,
        median_step_seconds=med,
        ratio_ours_over_trl=med["ours"] / med["trl"],
        peak_rss_mb={k: max(v) for k, v in rss.items()},
        samples=times,
    )
    print(json.dumps(out))
    print(f"\n| | s/step (median of {len(times['ours'])}) | peak RSS |\n|---|---|---|")
    for k, name in (("ours", "grpo.py"), ("trl", "TRL GRPOTrainer")):
        print(f"| {name} | {med[k]:.2f} | {max(rss[k]):.0f} MB |")
    print(f"\nratio grpo.py / TRL: {out['ratio_ours_over_trl']:.2f} (target <= 0.5)")
    (ROOT / "benchmarks" / "out").mkdir(parents=True, exist_ok=True)
    (ROOT / "benchmarks" / "out" / "speed_vs_trl.json").write_text(json.dumps(out, indent=1))
