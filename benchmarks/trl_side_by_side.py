"""TRL's GRPOTrainer (1.16) beside grpo.py on the same model, data file and reward: the evaluation metrics under
--eval-num-generations, and the types a reward function receives from the same data file (docs/trl.md).

Both sides use the bundled tiny model, held-out arith prompts in one JSONL file (its `code` column mixes 7, 2.5 and
"007", as a TRL user's file may), one reward function in TRL's convention (exact answer: 1.0, else 0.0) that also
records what it was given. TRL: `GRPOTrainer.evaluate()` with `num_generations_eval` samples per prompt in one eval
batch; ours: the step-0 evaluation of `grpo.py --task custom --eval-num-generations N`. Each side runs in a fresh
process of this Python (the same torch, transformers and datasets).

- `--temperature 1e-4` (the default; near greedy): both sides decode the same completions, so every metric must be the
  same to float precision: the script exits 1 where one differs.
- `--temperature 1.0`: the two samplers draw different completions; TRL's figures are also recomputed with ours
  (rlvr_utils/extras/trl_eval.metrics) on TRL's own completions, which must match TRL's exactly (the same definitions).
The row types: the list of type names and values of the `code` column each side's reward saw, which must be equal.

    pip install -r benchmarks/requirements.txt   # trl
    python benchmarks/trl_side_by_side.py [--temperature 1e-4] [--prompts 6] [--generations 4]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length")
METRICS += ("completions/max_length", "completions/clipped_ratio", "rewards/exact/mean", "rewards/exact/std")

REWARD = r'''
import json, os, re


def exact(prompts, completions, answer, code, completion_ids, **kwargs):
    """1.0 when the completion's `#### N` is the answer (TRL's convention); records what it was given."""
    out = []
    for c, a in zip(completions, answer):
        m = re.search(r"####\s*(-?\d+)", c)
        out.append(1.0 if m and int(m.group(1)) == int(a) else 0.0)
    seen = {"code": [[type(x).__name__, x] for x in code], "ids": completion_ids, "rewards": out}
    with open(os.environ["SEEN"], "a") as f:
        f.write(json.dumps(seen) + "\n")
    return out
'''

TRL = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
sys.path.insert(0, sys.argv[2])
from rewards import exact

data, out, n, G, temp, seed = sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7]), 1
rows = load_dataset("json", data_files=data, split="train")  # as a TRL user reads the file
tok = AutoTokenizer.from_pretrained(sys.argv[8])
model = AutoModelForCausalLM.from_pretrained(sys.argv[8])
cfg = GRPOConfig(
    output_dir=out, per_device_train_batch_size=G, num_generations=G, num_generations_eval=G,
    per_device_eval_batch_size=n * G, max_completion_length=48, temperature=temp, top_p=1.0, top_k=0, beta=0.0,
    loss_type="grpo", report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=seed,
    gradient_checkpointing=False, disable_tqdm=True, dataloader_num_workers=0,
)
trainer = GRPOTrainer(model=model, reward_funcs=exact, args=cfg, train_dataset=rows, eval_dataset=rows,
                      processing_class=tok)
print("RESULT " + json.dumps(trainer.evaluate()))
"""


def side(kind: str, data: Path, work: Path, n: int, G: int, temperature: float) -> dict:
    """One side in a fresh process: its evaluation metrics (TRL's names without eval_, ours without eval/) and the
    reward's records."""
    seen = work / f"seen_{kind}.jsonl"
    env = {"SEEN": str(seen), "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    model = str(ROOT / "assets" / "tiny-arith")
    if kind == "trl":
        args = [sys.executable, "-c", TRL, str(ROOT), str(work), str(data), str(work / "trl"), str(n), str(G)]
        args += [str(temperature), model]
    else:
        args = [sys.executable, str(ROOT / "grpo.py"), "--task", "custom", "--data-path", str(data), "--seed", "1"]
        args += ["--eval-data-path", str(data), "--reward-fn", f"{work / 'rewards.py'}:exact", "--num-eval", str(n)]
        args += ["--eval-num-generations", str(G), "--eval-temperature", str(temperature), "--total-steps", "1"]
        args += ["--prompts-per-step", "1", "--num-generations", str(G), "--max-new-tokens", "48"]
        args += ["--eval-every", "0", "--output-dir", str(work / "ours")]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode:
        sys.exit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    if kind == "trl":
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        metrics = {k.removeprefix("eval_"): v for k, v in json.loads(line[7:]).items()}
    else:
        (run,) = (work / "ours").iterdir()
        first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
        metrics = {k.removeprefix("eval/"): v for k, v in first.items() if k.startswith("eval/")}
    return {"metrics": metrics, "seen": [json.loads(x) for x in seen.read_text().splitlines()]}


def recomputed(seen: list[dict], G: int, eos: int) -> dict:
    """Our evaluation's metrics (rlvr_utils/extras/trl_eval.metrics) of the completions a side's reward was given."""
    import types

    import torch

    sys.path.insert(0, str(ROOT))
    from rlvr_utils.extras import trl_eval

    ids = [i for call in seen for i in call["ids"]]
    rewards = [r for call in seen for r in call["rewards"]]
    ro = types.SimpleNamespace(
        completion_mask=torch.tensor([len(i) for i in ids])[:, None],
        truncated=torch.tensor([not i or i[-1] != eos for i in ids]),
    )
    task = types.SimpleNamespace(with_reward_metrics=lambda out, mode: out)
    out = trl_eval.metrics(task, ro, rewards, G, 1.0, None, len(ids) // G)
    return {k.removeprefix("eval/"): v for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=1e-4)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--generations", type=int, default=4)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from rlvr_utils.core import models, tasks

    tok = models.load_tokenizer(str(ROOT / "assets" / "tiny-arith"))
    problems = tasks.load_task("arith", tok, seed=7, num_eval=a.prompts, arith_num_train=10).eval
    codes = [7, 2.5, "007"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "rewards.py").write_text(REWARD)
        data = work / "rows.jsonl"
        rows = [{"prompt": e.prompt, "answer": int(e.gold), "code": codes[i % 3]} for i, e in enumerate(problems)]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        trl, ours = (side(k, data, work, a.prompts, a.generations, a.temperature) for k in ("trl", "ours"))
    again = recomputed(trl["seen"], a.generations, tok.eos_token_id)
    print(f"{a.prompts} eval prompts x {a.generations} samples at temperature {a.temperature:g}\n")
    print("| metric | TRL eval_ | grpo.py eval/ | ours on TRL's completions |\n|---|---|---|---|")
    bad = []
    for k in METRICS:
        t, o, r = trl["metrics"].get(k, math.nan), ours["metrics"].get(k, math.nan), again.get(k)
        print(f"| {k} | {t:.6g} | {o:.6g} | {'-' if r is None else f'{r:.6g}'} |")  # rewards/*: the reward layer's
        bad += (
            [f"{k}: ours on TRL's completions {r} != TRL's {t}"]
            if r is not None and not math.isclose(r, t, abs_tol=1e-6)
            else []
        )
        if a.temperature <= 1e-3 and not math.isclose(o, t, abs_tol=1e-6):
            bad.append(f"{k}: grpo.py {o} != TRL {t} (near greedy: the same completions)")
    print(f"| accuracy | - | {ours['metrics'].get('accuracy', math.nan):.6g} | {again['accuracy']:.6g} |")
    types_trl = sorted({json.dumps(c) for call in trl["seen"] for c in call["code"]})
    types_ours = sorted({json.dumps(c) for call in ours["seen"] for c in call["code"]})
    print(f'\nthe `code` column (written 7, 2.5, "007") as the reward received it:\n  TRL:     {", ".join(types_trl)}')
    print(f"  grpo.py: {', '.join(types_ours)}")
    bad += [] if types_trl == types_ours else ["the reward received other values or types"]
    same = sorted(map(tuple, trl["seen"][0]["ids"])) == sorted(map(tuple, ours["seen"][0]["ids"]))  # the evaluations'
    print(f"\nthe evaluation's completions (token ids): {'the same' if same else 'not the same'} on both sides")
    bad += [] if same or a.temperature > 1e-3 else ["near greedy, the completions differ"]
    if bad:
        sys.exit("differences:\n  " + "\n  ".join(bad))
    print("\nsame metrics" + ("" if a.temperature <= 1e-3 else " on the same completions") + ", same row types")


if __name__ == "__main__":
    main()
