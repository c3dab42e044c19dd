"""The support package of the five scripts: one topic per module. What every script uses is in common.py; what is
not an algorithm lives here. Layers point one way: scripts -> common.py -> this package; nothing here imports
common.py or a script.

  cli              the command line: BaseArgs (every shared flag), parsing, resume, threads
  checks           every check before anything loads: one line naming the flag or file, exit code 2
  errors           that one line: usage_error and need
  model_files      a --model before it loads: its files whole and consistent, its tokenizer, the hub, its positions
  models           loading the policy (hub id or local directory, clear errors, dropout off)
  rollouts         the Rollouts batch, batched generation (HF generate or the vLLM engine), padding, stop tokens
  tracking         TensorBoard, metrics.jsonl and wandb
  tasks            the tasks (arith, gsm8k, math, code, custom): datasets, prompts, rewards, held-out split
  datafiles        local data files read as written (JSON rows keep their types), each row's file line
  custom           your own task: rows with a prompt, --reward-fn loading, RewardModel
  reward_calls     calling --reward-fn functions as TRL's GRPOTrainer does: kwargs, async, None, their metrics
  rewards          answer extraction and verification (GSM8K, MATH via math-verify)
  arith            the built-in arithmetic task: problems, solutions, its first-wrong-step oracle, the tiny model's
                   prompt formats
  sandbox          the code task's sandboxed test runner; sandbox_harness is the program it starts
  logprob_kernels  memory-bounded token log-probs: fused lm_head kernels, the padded batch's layout
  engines          the colocated vLLM rollout engine and its importance-sampling correction
  distributed      torchrun: DDP / FSDP2, sharding the batch, reducing metrics
  checkpoints      atomic checkpoints and resume
  model_card       the README.md --save-model writes beside the weights
  run_lock         one writer per run directory (a lock the kernel drops when the process ends)
  sharded          --fsdp's checkpoints: torch.distributed.checkpoint, resharded onto any world size
  stopping         Ctrl-C and SIGTERM (preemption): stop after the step, every rank at the same one; --reward-timeout
  teacher          SC-GRPO's self-conditioned teacher: its prompt, its forward (D without a [b, T, V] tensor), roles
  trace_diagnostics  GRPO-lambda's trace/* diagnostics and the closed form of its credit multiplier
  chains           SRPO's chain protocol: thoughts, the official stopping rules, the localization prompt and reply
  masked_stats     statistics over the valid entries of padded tensors: a per-row quantile, a z-score within cells
  ep_ablations     EP-GRPO's alternative forms, for the ablations on docs/ep_grpo.md (ep_grpo.py has the defaults)
  ep_diagnostics   EP-GRPO's ep/* diagnostics (logged; they change nothing in the update)
"""
