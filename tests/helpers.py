"""Run the scripts as users do: a subprocess, or in-process (runpy) when a test patches common.py."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import torch

import common

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def run_inprocess(script: str, *args: str) -> None:
    """Run `python script args...` inside this process (so monkeypatches of common apply)."""
    old = sys.argv
    sys.argv = [script, *args]
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    finally:
        sys.argv = old


def read_metrics(output_dir: Path) -> list[dict]:
    (run,) = [p for p in Path(output_dir).iterdir() if p.is_dir()]
    return [json.loads(line) for line in (run / "metrics.jsonl").open()]


def run_dir(output_dir: Path) -> Path:
    (run,) = [p for p in Path(output_dir).iterdir() if p.is_dir()]
    return run


def random_model(seed=0, vocab=61):
    """A random-init two-layer Qwen2 (vocabulary `vocab`), in eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(cfg).eval()


def padded_batch(prompts, completions, pad=0):
    """input ids, attention mask, completion mask and T of prompts left-padded + completions right-padded."""
    p_ids, p_mask = common.pad_left(prompts, pad)
    T = max(len(c) for c in completions)
    c_ids = torch.full((len(completions), T), pad)
    c_mask = torch.zeros((len(completions), T), dtype=torch.long)
    for i, c in enumerate(completions):
        c_ids[i, : len(c)] = torch.tensor(c)
        c_mask[i, : len(c)] = 1
    return torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1), c_mask, T
