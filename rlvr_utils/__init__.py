"""The support package of the five scripts, in folders by role, one topic per module. Layers point one way:
scripts -> common.py -> this package; nothing here imports common.py or a script. Inside, imports point down the roles
(core/ imports core/ only, methods/ the core, extras/ the core and extras) and no import cycle runs through the
modules, at any level (tests/test_layout.py). One variant per file (CleanRL): a script holds its paper's method; its
ablations' flags (<method>_ablations.Ablations) join its Args only when given (runtime.ablated), and it asks
args.ablation_module where one acts (docs/design.md). Module names are unique across the folders: runtime.extra,
REQUIRES and the docs name a module by its name, WHERE says its folder.

core/, what a default run loads (README: Copy one method); it reaches the rest only by name (runtime.extra):
  cli              the command line: BaseArgs (every shared flag), parsing, every check before anything loads
  flag_groups      the command line in --help's groups (the method's flags first), parsed by tyro, made flat again
  runtime          the one-line usage error, extras, one process's Dist, Ctrl-C, metrics and logs
  models           --model loaded (hub id or local directory), dropout off; the bundled default's one check; its
                   positions and attention window; `generate` with the run's flags alone
  tasks            Task and Example, prompts, answers, and the built-in arith task with its first-wrong-step oracle
  rollouts         the Rollouts batch and its generation: the static decoder (a preallocated KV cache, the model's
                   own weights), HF generate (--engine hf), or the vLLM engine when attached
  logprob_kernels  memory-bounded token log-probs: fused lm_head kernels, the padded batch's layout
  checkpoints      the run directory and its one-writer lock, the counted prompt stream, where checkpoints are
methods/, a method's own: its script loads the first four, a flag its ablations (runtime.ablated):
  teacher          SC-GRPO's D from the update's forward and one teacher forward, without a [b, T, V] tensor
  chains           SRPO's generate calls under its chain protocol (srpo.py has the rules, the prompt, the parser)
  trace_diagnostics  GRPO-lambda's trace/* metrics and the closed form of its credit multiplier
  ep_diagnostics   EP-GRPO's ep/* metrics (logged; they change nothing in the update)
  sc_ablations     SC-GRPO's ablation flags: --divergence sampled-logratio, --weighted-groups, --kl-threshold-scope
  ep_ablations     EP-GRPO's: the other forms (--gate, --pivot-scope, --process-granularity, ...), moving anchors
  srpo_ablations   SRPO's: --split 2x4 / 1x8, --no-mask, --clip
  lambda_ablations  GRPO-lambda's: --trace-apply weight (epsilon-weight)
extras/, each imported where its flag is handled (runtime.extra names every file a copy lacks):
  credit           --log-credit: each token's effective credit, read from the loss's gradient, and credit.jsonl
  lora             --lora-rank: PEFT adapters, the reference with adapters off, merged weights for vLLM and saves
  model_checks     a --model you give, checked before it loads: its config, weight files and tokenizer, or the hub
  trl_eval         --eval-num-generations: TRL's evaluation, samples per prompt and their training metrics under eval/
  unfused          token log-probs from the model's own logits (a model whose logits are not lm_head(h))
extras/data/, the tasks' extras: tasks from data and their verifiers, the arith task's other draws:
  arith_variants   --arith-variant: other ways to draw the arith task's problems (rising: GRPO-λ's premise)
  data_tasks       --task gsm8k/math/code/custom, --data-path, --reward-fn: datasets, data files, their checks
  datafiles        local data files checked line by line, then read as TRL's users read them (datasets), each row's line
  rewards          GSM8K and MATH answers (math-verify)
  sandbox          the code task's test runner: each program in one sandbox, its tests in another, the verdict theirs
  sandbox_bwrap    bubblewrap for it: one sandbox's command line, whether it can start here, ending it and all it began
  sandbox_harness  the program each sandbox starts (python -I -S -c): the program's side, the tests' side, an audit hook
extras/reward_fns/, TRL's --reward-fn layer:
  custom           --task custom and --reward-fn: your rows, loading reward functions, RewardModel
  reward_calls     calling --reward-fn functions as TRL's GRPOTrainer does: kwargs, async, None and NaN, failures
  reward_isolation  what one reward call may change or leave behind: its own copies, torch's state, alarms, forks
  reward_logs      what --reward-fn functions log: rewards/<name>/*, log_metric, log_extra's completions.jsonl
  watchdog         --reward-timeout: a reward call that runs too long is stopped with one line
extras/run_io/, the run's flags from a file and its metrics to trackers:
  config_file      --config FILE: a YAML, TOML or JSON file of flags (a run's config.json), the command line over it
  trackers         --report-to wandb / trackio / mlflow (TRL's names): the metrics through accelerate's trackers
extras/scale/, GPUs and many of them:
  distributed      torchrun: DDP / FSDP2, sharding the batch, reducing metrics
  engines          --engine vllm: the colocated vLLM rollout engine and its importance-sampling correction
  cuda_graphs      the static decoder's token step captured as a CUDA graph (decoding on a GPU)
  precision        --dtype bfloat16 (auto on a GPU): fp32 master weights and AdamW state, the model computing on bf16
                   copies of them; --pure-bf16 kahan's AdamW (optimi)
extras/save/, checkpoints, resuming them, the trained model:
  saving           writing atomic checkpoints (--save-every, Ctrl-C) and Hugging Face folders (--save-model)
  sharded          --fsdp's checkpoints: torch.distributed.checkpoint, resharded onto any world size
  resume           --resume: the run's flags and its checkpoint restored
  model_card       --save-model: the weights (LoRA: merged, or the adapter) and README.md beside them
"""

FOLDERS = {  # each module's folder: rlvr_utils/<folder>/<module>.py (the docstring's headings; tests/test_layout.py)
    "core": "cli flag_groups runtime models tasks rollouts logprob_kernels checkpoints",
    "methods": "teacher chains trace_diagnostics ep_diagnostics"  # loaded by their script
    + " sc_ablations ep_ablations srpo_ablations lambda_ablations",  # by a flag
    "extras": "credit lora model_checks trl_eval unfused",
    "extras/data": "arith_variants data_tasks datafiles rewards sandbox sandbox_bwrap sandbox_harness",
    "extras/reward_fns": "custom reward_calls reward_isolation reward_logs watchdog",
    "extras/run_io": "config_file trackers",
    "extras/scale": "distributed engines cuda_graphs precision",
    "extras/save": "saving sharded resume model_card",
}
WHERE = {module: folder for folder, modules in FOLDERS.items() for module in modules.split()}


# what each extra imports besides the core: runtime.extra names all a copy lacks in one line (tests/test_layout.py)
REQUIRES = {"data_tasks": ("model_checks",), "sandbox": ("sandbox_bwrap", "sandbox_harness")}  # the harness: as text
REQUIRES |= {"model_card": ("saving",), "sharded": ("saving",)}  # writing a checkpoint or a folder
REQUIRES["reward_calls"] = ("reward_isolation", "reward_logs", "watchdog")  # --reward-fn: TRL's reward calls
REQUIRES["custom"] = ("reward_calls", *REQUIRES["reward_calls"])
