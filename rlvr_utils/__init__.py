"""The support package of the five scripts: one topic per module. What every script uses is in common.py; what is
not an algorithm lives here. Layers point one way: scripts -> common.py -> this package; nothing here imports
common.py or a script, and no import cycle runs through the modules below (one line each; tests/test_layout.py).

  cli              the command line: BaseArgs (every shared flag), parsing, resume, threads
  checks           every check before anything loads: one line naming the flag or file, exit code 2
  errors           that one line: usage_error and need
  model_files      a --model before it loads: its files whole and consistent, its tokenizer, the hub, its positions
  models           loading the policy (hub id or local directory, clear errors, dropout off)
  rollouts         the Rollouts batch, batched generation (HF generate or the vLLM engine), padding, stop tokens
  tracking         TensorBoard, metrics.jsonl and wandb
  credit           each token's effective credit, read from the loss's gradient (--log-credit N), and credit.jsonl
  tasks            the tasks (arith, gsm8k, math, code, custom): datasets, prompts, rewards, held-out split
  datafiles        local data files read as written (JSON rows keep their types), each row's file line
  custom           your own task: rows with a prompt, --reward-fn loading, RewardModel
  reward_calls     calling --reward-fn functions as TRL's GRPOTrainer does: kwargs, async, None, their metrics
  rewards          answer extraction and verification (GSM8K, MATH via math-verify)
  arith            the built-in arithmetic task: problems, solutions, its first-wrong-step oracle, the tiny model's
                   prompt formats
  sandbox          the code task's sandboxed test runner (not a security boundary)
  sandbox_harness  the program the sandbox starts (python -I -c): rlimits, an audit hook, then the program and its tests
  logprob_kernels  memory-bounded token log-probs: fused lm_head kernels, the padded batch's layout
  engines          the colocated vLLM rollout engine and its importance-sampling correction
  distributed      torchrun: DDP / FSDP2, sharding the batch, reducing metrics
  checkpoints      atomic checkpoints and resume
  model_card       the README.md --save-model writes beside the weights
  run_lock         one writer per run directory (a lock the kernel drops when the process ends)
  sharded          --fsdp's checkpoints: torch.distributed.checkpoint, resharded onto any world size
  stopping         Ctrl-C and SIGTERM (preemption): stop after the step, every rank at the same one; --reward-timeout
  teacher          SC-GRPO's teacher forward: D without a [b, T, V] tensor (sc_grpo.py has its prompt, roles and KL)
  trace_diagnostics  GRPO-lambda's trace/* diagnostics and the closed form of its credit multiplier
  chains           SRPO's generate calls under its chain protocol (srpo.py has the rules, the prompt, the parser)
  ep_ablations     EP-GRPO's alternative forms, for the ablations on docs/ep_grpo.md (ep_grpo.py has the defaults)
  ep_diagnostics   EP-GRPO's ep/* diagnostics (logged; they change nothing in the update)
"""
