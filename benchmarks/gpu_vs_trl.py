"""Benchmark: peak GPU memory and median step time, grpo.py against TRL's GRPOTrainer, on random-init models of real
shapes (Qwen2.5-0.5B and -1.5B: the real 151,936-token vocabulary), built offline, with the same batch, engine
(Hugging Face generate), optimizer (AdamW), loss (the original GRPO's, TRL loss_type="grpo"), beta 0 and gradient
checkpointing setting on both sides. One invocation runs both, alternating, each in a fresh process.

    python benchmarks/gpu_vs_trl.py --shapes 0.5b 1.5b                          # GPU (bf16), the issue's setting
    python benchmarks/gpu_vs_trl.py --shapes tiny --steps 2 --prompts 2 --generations 2 --max-new-tokens 8   # CPU
    python benchmarks/gpu_vs_trl.py --shapes 1.5b --build /tmp/qwen1.5b-shaped   # the model alone, for any script
    python benchmarks/gpu_vs_trl.py --shapes 1.5b --lora 64                      # both sides under LoRA r 64

The prompts are the built-in arith task's, tokenized with the bundled character tokenizer; token ids beyond its
vocabulary decode to nothing, so every reward is 0 and neither side is sped up by a stop token (a random model never
samples it): both generate all --max-new-tokens tokens and run the full forward and backward (a zero advantage still
costs the same compute). Per step: grpo.py's time/step and memory/peak_gb (reset each step); TRL's on_step_begin ->
on_step_end and torch.cuda.max_memory_allocated reset at each step's start. Step time: the median over --steps (7)
steps after the first --warmup (2), which vary most (4-17 s for the same step on an H200); every step's time is
printed and saved beside it. On CPU: each process's own peak RSS instead of GPU memory. --lora R: grpo.py with
--lora-rank R and TRL with a PEFT LoraConfig of the same rank, alpha and target modules (every linear layer of the
blocks). Prints a side-by-side table and writes benchmarks/out/gpu_vs_trl.json. Needs trl
(pip install -r benchmarks/requirements.txt).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from harness import run_script

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # Qwen2.5 configurations (hidden, intermediate, layers, heads, kv heads, vocabulary)
    "0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    ),
    "1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}


def build_model(shape: str, out: Path, vocab: int) -> Path:
    """A random-init Qwen2 model of `shape` with the bundled tokenizer, saved as a Hugging Face directory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(ROOT))
    import common
    from rlvr_utils.core import models

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
        **SHAPES[shape],
    )
    model = Qwen2ForCausalLM(cfg)
    tok = models.load_tokenizer(common.DEFAULT_MODEL)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


TRL = r"""
import json, sys, time
sys.path.insert(0, ".")
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from rlvr_utils.core import models, tasks

cuda = torch.cuda.is_available()
tok = models.load_tokenizer({model!r})
tok.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained({model!r}, dtype=torch.bfloat16 if cuda else torch.float32)
peft = None
if {lora}:  # --lora: the same adapters as grpo.py's --lora-rank (PEFT's all-linear: the blocks, not the lm_head)
    from peft import LoraConfig
    peft = LoraConfig(r={lora}, lora_alpha={lora}, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
task = tasks.load_task("arith", tok, seed=1, num_eval=1, arith_num_train=1000)
data = Dataset.from_list([dict(prompt=e.prompt) for e in task.train])
times, peaks = [], []
class Clock(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        times.append(time.perf_counter() - self.t0)
        peaks.append(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
cfg = GRPOConfig(output_dir=sys.argv[sys.argv.index("--output-dir") + 1], per_device_train_batch_size={micro},
                 gradient_accumulation_steps={accum}, num_generations={G}, generation_batch_size={prompts} * {G},
                 max_completion_length={max_new}, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
                 loss_type="grpo", learning_rate=1e-6, max_steps={steps}, logging_steps=1, report_to=[],
                 save_strategy="no", use_cpu=not cuda, bf16=cuda, seed=1, disable_tqdm=True,
                 gradient_checkpointing={gc}, dataloader_num_workers=0)
trainer = GRPOTrainer(model=model, reward_funcs=lambda prompts, completions, **kw: [0.0] * len(completions), args=cfg,
                      train_dataset=data, processing_class=tok, callbacks=[Clock()], peft_config=peft)
trainer.train()
print("RESULT", json.dumps(dict(step_seconds=times, peak_gb=peaks)))
"""


def run(kind: str, model: Path, a) -> dict:
    """One side in a fresh process: step times (s), per-step peak GPU memory (GB), the process's own peak RSS (GB)."""
    if kind == "ours":
        flags = ["--model", str(model), "--total-steps", str(a.steps), "--eval-every", "0", "--num-eval", "1"]
        flags += ["--prompts-per-step", str(a.prompts), "--num-generations", str(a.generations)]
        flags += ["--max-new-tokens", str(a.max_new_tokens), "--learning-rate", "1e-6"]
        flags += ["--gen-batch-size", str(a.prompts * a.generations), "--micro-batch-size", str(a.micro_batch_size)]
        flags += ["--engine", "hf", "--seed", "1"] + (["--gradient-checkpointing"] if a.gradient_checkpointing else [])
        flags += ["--lora-rank", str(a.lora), "--lora-alpha", str(a.lora)] if a.lora else []
        res = run_script(["grpo.py", *flags]).check(kind)
        step_seconds, peak_gb = [r["time/step"] for r in res.steps], [r.get("memory/peak_gb", 0.0) for r in res.steps]
    else:
        code = TRL.format(
            model=str(model),
            steps=a.steps,
            prompts=a.prompts,
            G=a.generations,
            max_new=a.max_new_tokens,
            micro=a.micro_batch_size,
            accum=max(1, a.prompts * a.generations // a.micro_batch_size),
            gc=a.gradient_checkpointing,
            lora=a.lora,
        )
        res = run_script(["-c", code]).check(kind)
        out = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT"))[7:])
        step_seconds, peak_gb = out["step_seconds"], out["peak_gb"]
    return dict(step_seconds=step_seconds, peak_gb=peak_gb, maxrss_gb=res.peak_rss_mb / 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"], choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=7, help="steps per side (at least 7 for a timing to report)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the median step time")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on both sides (0: full fine-tuning)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward/backward on both sides")
    ap.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--sides", nargs="+", default=["ours", "trl"], choices=["ours", "trl"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "gpu_vs_trl.json"))
    ap.add_argument(
        "--build", metavar="DIR", help="only save the first --shapes model to DIR (for running any script on it)"
    )
    a = ap.parse_args()
    a.micro_batch_size = min(a.micro_batch_size, a.prompts * a.generations)  # TRL needs accum x micro = the batch
    if a.build:
        print(f"saved a random-init {a.shapes[0]} model to {build_model(a.shapes[0], Path(a.build), a.vocab)}")
        return
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (peak RSS instead of GPU memory)"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in a.shapes:
            model = build_model(shape, Path(tmp) / shape, a.vocab)
            for kind in a.sides:
                res = run(kind, model, a)
                steps = res["step_seconds"][a.warmup :] or res["step_seconds"]  # warm-up steps left out
                first = a.warmup + 1 if len(res["step_seconds"]) > a.warmup else 1  # too few steps: all of them
                mem = max(res["peak_gb"]) if torch.cuda.is_available() else res["maxrss_gb"]
                results[f"{shape}/{kind}"] = dict(
                    median_step_seconds=statistics.median(steps), peak_gb=mem, step_seconds=res["step_seconds"]
                )
                every = ", ".join(f"{t:.2f}" for t in res["step_seconds"])
                print(f"{shape} {kind}: median {statistics.median(steps):.2f} s/step over steps {first}-"
                      f"{len(res['step_seconds'])} (every step: {every}), peak {mem:.2f} GB", flush=True)  # fmt: skip
    lines = [
        f"device: {device}; {a.prompts} prompts x {a.generations} completions x {a.max_new_tokens} new tokens, "
        f"micro-batch {a.micro_batch_size}, gradient checkpointing {'on' if a.gradient_checkpointing else 'off'}, "
        + (f"LoRA r {a.lora}" if a.lora else "full fine-tuning")
        + f"; median step time over steps {a.warmup + 1 if a.steps > a.warmup else 1}-{a.steps}",
        "",
        "| shape | grpo.py s/step | TRL s/step | ratio | grpo.py peak GB | TRL peak GB | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape in a.shapes:
        o, t = results.get(f"{shape}/ours"), results.get(f"{shape}/trl")
        if o and t:
            lines.append(
                f"| {shape} | {o['median_step_seconds']:.2f} | {t['median_step_seconds']:.2f} | "
                f"{o['median_step_seconds'] / t['median_step_seconds']:.2f} | {o['peak_gb']:.2f} | "
                f"{t['peak_gb']:.2f} | {o['peak_gb'] / t['peak_gb']:.2f} |"
            )
    print("\n".join(lines))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(dict(device=device, args=vars(a), results=results, table=lines), indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
