"""The support package of the five scripts: one topic per module. What every script uses is in common.py; what is
not an algorithm lives here. Layers point one way: scripts -> common.py -> this package; nothing here imports
common.py or a script.

  cli              the command line: parsing, one-line errors for bad flags, resume, threads
  tasks            the tasks (arith, gsm8k, math, code): datasets, prompts, rewards, held-out split
  rewards          answer extraction and verification (GSM8K, MATH via math-verify)
  arith            the built-in arithmetic task: problems, solutions, its first-wrong-step oracle, the tiny model's
                   prompt formats
  sandbox          the code task's sandboxed test runner; sandbox_harness is the program it starts
  logprob_kernels  memory-bounded token log-probs: fused lm_head kernels, the padded batch's layout
  engines          the colocated vLLM rollout engine and its importance-sampling correction
  distributed      torchrun: DDP / FSDP2, sharding the batch, reducing metrics
  checkpoints      atomic checkpoints, resume, Ctrl-C
  masked_stats     statistics over the valid entries of padded tensors: a per-row quantile, a z-score within cells
  ep_ablations     EP-GRPO's alternative forms, for the ablations on docs/ep_grpo.md (ep_grpo.py has the defaults)
  ep_diagnostics   EP-GRPO's ep/* diagnostics (logged; they change nothing in the update)
"""
