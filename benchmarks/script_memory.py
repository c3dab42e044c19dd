"""Peak memory of every script on the same run at a real vocabulary, next to grpo.py's.

The model is the bundled tiny policy (assets/tiny-arith) with its vocabulary grown to --vocab rows (151,936: Qwen2.5's),
so it still solves the built-in arith task and every method's machinery really runs (SC-GRPO's teachers need
partial-solve groups). The new rows are one direction that every final hidden state of the model's own completions
points away from (minus their mean, scaled so that each new token's logit is at most -40): their total probability is
below 1e-10, so sampling and rewards are those of the tiny model while every [., V] tensor has the real width.

Each script runs --steps steps of --prompts prompts x --generations completions (seed 1, the same first batch for
all, --eval-every 0 with --num-eval prompts) in a fresh process. Peak memory: on CPU the process's peak resident set
size (VmHWM: model, optimizer, rollouts, update, evaluation, everything) and the peak of its update phases alone (VmHWM
reset through /proc/self/clear_refs when step 3 calls common.group_advantages, read when the next step starts
(runtime.reset_peak_memory) or the evaluation does: credit assignment, extra passes, forward, backward, optimizer step);
on a GPU (--device cuda) the largest memory/peak_gb the script logs (torch.cuda.max_memory_allocated, reset each
step). Prints a markdown table and writes benchmarks/out/script_memory_<device>.json.

    python benchmarks/script_memory.py                                   # CPU, vocabulary 151,936
    python benchmarks/script_memory.py --device cuda
    python benchmarks/script_memory.py --root /tmp/other-checkout        # the same run with another checkout's scripts
    python benchmarks/script_memory.py --lora 16                         # and each script again with --lora-rank 16
    python benchmarks/script_memory.py --engines default                 # only the default engine's rows
    python benchmarks/script_memory.py --dtype bfloat16                  # bf16 compute: fp32 masters (precision.py)
    python benchmarks/script_memory.py --dtype bfloat16 --pure-bf16 plain   # bf16 weights under a plain AdamW

--lora R: every script runs twice, full fine-tuning and `--lora-rank R` (the adapters train; the reference policy of
the KL term and EP-GRPO's delta is the same model with its adapters off, no copy); a LoRA row's "x grpo.py" is against
grpo.py under LoRA.

--engines (default: both): every script at the default engine (the static decoder, rlvr_utils/core/rollouts.py; vLLM
where it is installed on a GPU) and again with `--engine hf` (transformers' generate); a row's "x grpo.py" is against
grpo.py under the same engine, and a default-engine row's "x hf" is its peak over the same script's under
`--engine hf`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import read_metrics

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "grpo": ["grpo.py"],
    "sc_grpo": ["sc_grpo.py"],
    "grpo_lambda": ["grpo_lambda.py"],
    "ep_grpo": ["ep_grpo.py"],
    "srpo": ["srpo.py"],  # every script at its defaults; then SC-GRPO's modes that cost more
    "sc_grpo --kl-threshold-scope batch": ["sc_grpo.py", "--kl-threshold-scope", "batch"],
    "sc_grpo --kl-loss-coef 0.1": ["sc_grpo.py", "--kl-loss-coef", "0.1"],
}


def grow_vocab(src: Path, out: Path, vocab: int, margin: float = 40.0) -> Path:
    """`src` (a tied-embedding causal LM) with its vocabulary grown to `vocab` rows that it never samples, saved to
    `out` with src's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    import common
    from rlvr_utils.core import models, tasks

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tok = models.load_tokenizer(str(src))
    task = tasks.load_task("arith", tok, seed=1, num_eval=32)
    ids, mask = common.pad_left([tasks.encode_prompt(tok, e.prompt) for e in task.eval], tok.pad_token_id)
    with torch.no_grad():
        seqs = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=48, do_sample=True, pad_token_id=tok.pad_token_id
        )
        h = model(input_ids=seqs, output_hidden_states=True).hidden_states[-1].flatten(0, 1)  # [n, H] final (normed)
    u = -h.mean(0) / h.mean(0).norm()
    worst = (h @ u).max().item()  # the largest logit a row along u gets, per unit of scale
    if worst >= 0:
        raise RuntimeError(f"{src}: no direction all its hidden states point away from (max projection {worst:.3f})")
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(vocab, mean_resizing=False)
    with torch.no_grad():
        W = model.get_output_embeddings().weight
        W[old:] = u * (margin / -worst) + 1e-3 * torch.randn(vocab - old, W.shape[1])
        p_new = 0.0
        for part in seqs.split(
            4
        ):  # a few sequences at a time: [32, 58, V] fp32 logits are 1 GiB, their softmax another
            z = model(input_ids=part).logits
            p_new = max(p_new, (z[..., old:].logsumexp(-1) - z.logsumexp(-1)).max().exp().item())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"grew {src.name} to {vocab} rows in {out}: new tokens' total probability <= {p_new:.1e}", flush=True)
    return out


WRAPPER = r"""
import json, os, runpy, sys
sys.path.insert(0, os.getcwd())
import common
try:
    from rlvr_utils.core import runtime
except ImportError:  # a --root checkout from before the package's folders (86719d2)
    from rlvr_utils import runtime

def hwm():
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")) / 2**20  # GiB

state = dict(process=0.0, update=[], open=False)

def close():
    state["process"] = max(state["process"], hwm())
    if state["open"]:
        state["update"].append(hwm())
        state["open"] = False

def wrap(fn, starts_update):
    def inner(*a, **k):
        if not starts_update:
            close()
        elif not state["open"]:  # step 3 begins: the rollouts are done
            state["process"] = max(state["process"], hwm())
            open("/proc/self/clear_refs", "w").write("5")  # VmHWM := the current RSS
            state["open"] = True
        return fn(*a, **k)
    return inner

common.group_advantages = wrap(common.group_advantages, True)
runtime.reset_peak_memory = wrap(runtime.reset_peak_memory, False)
common.evaluate = wrap(common.evaluate, False)
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    close()
    print("PEAKS", json.dumps(state), file=sys.stderr, flush=True)
"""


def run_one(root: Path, cmd: list[str], threads: int) -> dict:
    """One script in a fresh process: its own peak RSS (GiB, VmHWM read inside it), its step rows and its exit status.
    Not wait4's ru_maxrss: subprocess starts the child with vfork + exec, and Linux then reports the *parent's*
    high-water mark for the child whenever the parent's is higher (here the vocabulary growing's)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-c", WRAPPER, *cmd, "--output-dir", tmp, "--threads", str(threads)],
            cwd=root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        rows = read_metrics(tmp)
    steps = [r for r in rows if "time/step" in r]
    peaks = json.loads(next((x[6:] for x in err.splitlines() if x.startswith("PEAKS ")), "{}"))
    rss = peaks["process"] if "process" in peaks else usage.ru_maxrss / 2**20  # ru_maxrss (KiB) only as a fallback
    res = dict(rc=proc.returncode, rss_gb=rss, update_rss_gb=max(peaks.get("update") or [0.0]), steps=len(steps))
    if steps:
        res.update(
            s_per_step=statistics.median(r["time/step"] for r in steps),
            update_s=statistics.median(r["time/update"] for r in steps),
            teacher_s=statistics.median(r.get("time/teacher", 0.0) for r in steps),
            gpu_peak_gb=max(r.get("memory/peak_gb", 0.0) for r in steps),
            sc_routed=sum(r.get("sc/groups_partial", 0.0) + r.get("sc/groups_none", 0.0) for r in steps) / len(steps),
        )
    if proc.returncode:
        res["error"] = err.strip().splitlines()[-1][:300] if err.strip() else f"exit {proc.returncode}"
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--num-eval", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads per script (0: one per core)")
    ap.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS))
    ap.add_argument("--model", default=str(ROOT / "assets" / "tiny-arith"), help="the policy whose vocabulary is grown")
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose scripts run")
    ap.add_argument("--out", default=None, help="default: benchmarks/out/script_memory_<device>.json")
    ap.add_argument("--lora", type=int, default=0, help="also run every script with --lora-rank LORA (0: no)")
    ap.add_argument("--lora-only", action="store_true", help="with --lora: skip the full fine-tuning rows")
    ap.add_argument(
        "--engines", nargs="+", default=["default", "hf"], choices=["default", "hf"], help="rollout engines"
    )
    ap.add_argument("--dtype", default=None, help="every script's --dtype (default: theirs, float32 on CPU)")
    ap.add_argument("--pure-bf16", default=None, help="every script's --pure-bf16 (kahan or plain: no fp32 masters)")
    a = ap.parse_args()
    if a.lora_only and not a.lora:
        ap.error("--lora-only needs --lora R (R > 0)")
    gpu = a.device.startswith("cuda")
    flags = [
        "--device",
        a.device,
        "--total-steps",
        str(a.steps),
        "--prompts-per-step",
        str(a.prompts),
        "--num-generations",
        str(a.generations),
        "--max-new-tokens",
        str(a.max_new_tokens),
        "--eval-every",
        "0",
        "--num-eval",
        str(a.num_eval),
        "--seed",
        "1",
    ]
    flags += ["--dtype", a.dtype] if a.dtype else []
    flags += ["--pure-bf16", a.pure_bf16] if a.pure_bf16 else []
    res = {"vocab": a.vocab, "device": a.device, "flags": flags, "root": a.root, "lora": a.lora, "scripts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = grow_vocab(Path(a.model), Path(tmp) / "grown", a.vocab)
        if Path("/proc/self/clear_refs").exists():  # this process's own peak must not reach the children's figures
            Path("/proc/self/clear_refs").write_text("5")
        lora = [f" --lora-rank {a.lora}"] if a.lora else []
        engines = [" --engine hf" if e == "hf" else "" for e in a.engines]
        tiers = [t + e for t in ([] if a.lora_only else [""]) + lora for e in engines]
        for name, tier in [(n, t) for t in tiers for n in a.scripts]:  # full fine-tuning first, then LoRA
            cmd = [*SCRIPTS[name], "--model", str(model), *flags, *tier.split()]
            r = res["scripts"][name + tier] = run_one(Path(a.root), cmd, a.threads) | {"tier": tier}
            print(name + tier, json.dumps(r), flush=True)
    keys = ["gpu_peak_gb"] if gpu else ["rss_gb", "update_rss_gb"]
    heads = (
        ["peak GPU memory allocated, GB"] if gpu else ["peak RSS of the process, GiB", "peak RSS in the update, GiB"]
    )
    lines = [
        "| script | "
        + " | ".join(f"{h} | x grpo.py" for h in heads)
        + " | peak x --engine hf's | s/step | update s | routed SC-GRPO groups |",
        "|---|" + "---|---|" * len(keys) + "---|---|---|---|",
    ]
    for name, r in res["scripts"].items():
        if r["rc"] or not r["steps"]:
            lines.append(f"| {name} | failed: {r.get('error', '')} |")
            continue
        base = res["scripts"].get("grpo" + r["tier"], {})  # against grpo.py with the same LoRA rank and engine
        cells = [f"{r[k]:.2f} | {r[k] / base[k]:.2f}" if base.get(k) else f"{r[k]:.2f} | -" for k in keys]
        r["vs_grpo"] = {k: r[k] / base[k] for k in keys if base.get(k)}
        hf = res["scripts"].get(name + " --engine hf", {})  # none for an --engine hf row
        r["vs_hf"] = {k: r[k] / hf[k] for k in keys if hf.get(k)}  # the default engine's over generate's
        cells.append(f"{r['vs_hf'][keys[0]]:.2f}" if keys[0] in r["vs_hf"] else "")
        routed = f"{r['sc_routed']:.2f}" if name.startswith("sc_grpo") else ""
        lines.append(f"| {name} | {' | '.join(cells)} | {r['s_per_step']:.2f} | {r['update_s']:.2f} | {routed} |")
    print("\n".join(lines))
    res["table"] = lines
    out = Path(a.out or ROOT / "benchmarks" / "out" / f"script_memory_{'cuda' if gpu else 'cpu'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    if any(r["rc"] for r in res["scripts"].values()):
        sys.exit("a script failed: see the table")


if __name__ == "__main__":
    main()
