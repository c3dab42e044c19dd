"""GRPO: group-relative policy optimization, the baseline every method here is measured against.

For each prompt, sample G completions, score them with a verifiable reward, and give every token of
a completion the same advantage: its reward minus the group's mean, divided by the group's std.
The policy maximizes a PPO-clipped surrogate of that advantage, optionally with a k3 KL penalty to
a frozen reference. Flags reproduce the common variants: DAPO (token-mean, clip-higher, dynamic sampling,
overlong shaping, several mini-batch steps per batch) and Dr. GRPO (no std scaling, constant-length normalization).
Paper: Shao et al. 2024, DeepSeekMath (arXiv 2402.03300). Docs: README.md, docs/grpo_variants.md.

    python grpo.py                                              # bundled tiny model, built-in task, CPU
    python grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --learning-rate 1e-6 --max-new-tokens 512 \\
        --gradient-checkpointing
"""

import copy
import dataclasses
import time
from pathlib import Path
from typing import Literal

import torch
from tqdm import trange

from rlvr_utils import checkpoints
from rlvr_utils import cli
import common
from rlvr_utils import distributed
from rlvr_utils import engines
from rlvr_utils import tasks


@dataclasses.dataclass
class Args:
    exp_name: str = "grpo"
    """name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment (prompts, sampling, initialization)"""
    track: bool = False
    """log to Weights & Biases as well as TensorBoard (needs pip install wandb)"""
    wandb_project: str = "credit-rlvr"
    """wandb project name (with --track)"""
    output_dir: str = "runs"
    """logs, metrics.jsonl and checkpoints go to <output-dir>/<run-name>/"""
    save_model: bool = False
    """save the final policy as a Hugging Face directory <output-dir>/<run-name>/model (atomic write)"""
    save_every: int = 0
    """write a resumable checkpoint (<run-dir>/checkpoint: model, optimizer, RNG states, data position) every this
    many steps and at the end; 0: only when the run is stopped with Ctrl-C"""
    resume: str | None = None
    """continue the run in this run directory from its checkpoint, with the flags it was started with (--total-steps may grow)"""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """model dtype: auto is bfloat16 on cuda, float32 on cpu"""
    threads: int = 0
    """torch CPU threads (0: torch's default, one per core)"""

    # model and task
    model: str = common.DEFAULT_MODEL
    """Hugging Face hub id or local directory of the policy; the default is the bundled tiny model"""
    task: Literal["arith", "gsm8k", "math", "code"] = "arith"
    """arith (built in), gsm8k, math, or code (HumanEval-style unit tests run in a sandbox; reward = fraction passed)"""
    data_path: str | None = None
    """local jsonl/json/parquet training file instead of the hub dataset (gsm8k, math, code; code also .jsonl.gz)"""
    eval_data_path: str | None = None
    """local eval file; without it the first --num-eval training rows are held out"""
    arith_steps: int = 4
    """arith: operations per problem"""
    arith_max_value: int = 99
    """arith: running values stay in [0, this]"""
    arith_max_operand: int = 9
    """arith: operands are drawn from [1, this]"""
    code_timeout: float = 5.0
    """code task: wall-clock seconds for one program's whole test run (also its CPU-time limit)"""
    max_prompt_length: int = 1024
    """prompts longer than this (tokens) are skipped and counted"""

    # rollouts
    total_steps: int = 150
    """training steps; each samples a new batch of prompts and makes num-iterations x num-minibatches optimizer steps"""
    prompts_per_step: int = 8
    """prompts per step (the global batch: across all torchrun ranks, divisible by their number); each gets --num-generations completions"""
    num_generations: int = 8
    """G: completions per prompt (the group; at least 2)"""
    max_new_tokens: int = 48
    """completion length cap (tokens); completions that hit it count as clipped"""
    temperature: float = 1.0
    """sampling temperature; log-probs use the same temperature"""
    top_p: float = 1.0
    """nucleus sampling (1.0 = off; truncated sampling biases the ratio)"""
    top_k: int = 0
    """top-k sampling (0 = off)"""
    gen_batch_size: int = 64
    """sequences per generate() call"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts until the batch is full again"""
    max_sampling_rounds: int = 3
    """with --dynamic-sampling: at most this many sampling rounds per step (then groups that were dropped fill the batch)"""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: a completion longer than max-new-tokens minus this loses reward linearly, up to
    --overlong-penalty-factor at max-new-tokens (0: off)"""
    overlong_penalty_factor: float = 1.0
    """the largest overlong penalty (with --overlong-buffer)"""
    mask_truncated_completions: bool = False
    """completions that hit --max-new-tokens get no loss (DAPO's overlong filtering)"""

    # optimization
    learning_rate: float = 1e-4
    """AdamW learning rate (constant). The default suits the tiny model; use ~1e-6 for 1B+ models"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    num_iterations: int = 1
    """mu: passes over each batch (with one mini-batch and mu = 1 the update is on-policy: the ratio is exactly 1)"""
    num_minibatches: int = 1
    """each pass splits the batch into this many mini-batches of whole prompts, one optimizer step each (CleanRL's
    name; DAPO/verl: 4); only the first step is on-policy, so the ratio leaves 1 and clipping acts"""
    epsilon: float = 0.2
    """lower clip: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]"""
    epsilon_high: float | None = None
    """upper clip (DAPO's clip-higher uses 0.28); default: same as --epsilon"""
    beta: float = 0.0
    """k3 KL coefficient to the frozen initial policy (0: no reference model is loaded)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """token-mean (DAPO), seq-mean-token-mean (original GRPO), seq-mean-token-sum-norm (Dr. GRPO)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantage scaling: group std (GRPO), batch std (Lite PPO) or none (Dr. GRPO)"""
    micro_batch_size: int = 16
    """sequences per forward/backward (gradient accumulation; the loss is normalized over the whole mini-batch)"""
    gradient_checkpointing: bool = False
    """recompute each decoder layer's activations in the backward (non-reentrant) instead of storing them: trades
    about a third more update time for much less GPU memory on long completions (the README's GPU commands use it)"""

    # evaluation
    eval_every: int = 25
    """steps between evaluations (0 = only at the start and end)"""
    num_eval: int = 200
    """held-out prompts per evaluation"""
    eval_temperature: float = 0.0
    """0 = greedy pass@1"""

    # rollout engine
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """hf (transformers generate), vllm (a colocated vLLM engine synced after every optimizer step), or auto:
    vllm when it is importable and a GPU is present, else hf"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (on CPU: of host memory)"""
    vllm_is_cap: float = 0.0
    """truncated importance-sampling correction min(pi_old / pi_vllm, cap) per token; 0 = off"""

    # several processes: torchrun --nproc_per_node N <script> ... (docs/scaling.md)
    fsdp: bool = False
    """under torchrun: shard the policy (and reference) with FSDP2 fully_shard instead of DDP"""
    dist_timeout: int = 1800
    """seconds a collective waits for the other ranks before the run stops with an error"""


def validate(args: Args) -> Args:
    """Every flag checked before anything loads: a user error ends with one line naming the flag, exit code 2."""
    args = cli.resume_args(args, Args) if args.resume else args
    cli.check_common(args)
    cli.need(args.num_generations >= 2, f"--num-generations must be >= 2 (GRPO compares the completions of a prompt), "
             f"got {args.num_generations}")
    return dataclasses.replace(args, epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high)


if __name__ == "__main__":
    args = validate(cli.parse(Args))  # tyro.cli(Args), its errors on one line
    cli.set_threads(args.threads)
    run_dir = Path(args.resume or Path(args.output_dir) / f"{args.task}__{args.exp_name}__{args.seed}__{int(time.time())}")

    # seeding, model, task; a resumed run then restores its checkpoint into them
    dist, device = distributed.init_distributed(args.device, vars(args), args.prompts_per_step, args.dist_timeout, args.fsdp)
    common.seed_everything(args.seed + dist.rank)  # per-rank sampling; every rank draws the same global prompt batches
    model, tokenizer = common.load_policy(args.model, device, args.dtype, args.gradient_checkpointing)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if args.beta > 0 else None
    train_model = dist.wrap(model, ref_model)  # DDP / FSDP2 under torchrun; the model itself otherwise
    task = tasks.load_task(
        args.task, tokenizer, seed=args.seed, num_eval=args.num_eval, data_path=args.data_path,
        eval_data_path=args.eval_data_path, max_prompt_length=args.max_prompt_length, arith_steps=args.arith_steps,
        arith_max_value=args.arith_max_value, arith_max_operand=args.arith_max_operand, code_timeout=args.code_timeout,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    batches = checkpoints.CountingBatches(lambda: common.prompt_batches(task.train, args.prompts_per_step, args.seed))
    ckpt, stop = checkpoints.Checkpointer(run_dir, args.save_every, dist), checkpoints.GracefulStop()
    start = ckpt.restore(model, optimizer, batches) if args.resume else 0
    engines.attach_engine(args.engine, model, optimizer, args.model, args.vllm_gpu_memory_utilization, seed=args.seed + dist.rank)
    logger = common.Logger(run_dir, vars(args), args.track, args.wandb_project, enabled=dist.main, resume_step=start)
    dist.print(f"run {run_dir.name}: logs in {run_dir}/ (tensorboard --logdir {run_dir.parent}); {len(task.train)} train / "
               f"{len(task.eval)} eval prompts; skipped {task.skipped}" + (f"; resumed after step {start}" if start else ""))
    G = args.num_generations

    if not start:  # a resumed run has its evaluations in its metrics.jsonl already
        logger.log(common.evaluate(model, tokenizer, task, args.max_new_tokens, args.gen_batch_size, args.eval_temperature, dist), 0)
    eval_metrics = metrics = logger.last_eval
    bar = trange(start + 1, args.total_steps + 1, initial=start, total=args.total_steps, desc="grpo", dynamic_ncols=True,
                 disable=not dist.main)
    for step in bar:
        # 1-2. rollouts: G completions per prompt, and one reward per completion (the verifier sees the decoded text);
        #      DAPO's dynamic sampling and overlong penalty when asked
        t0 = time.time()
        common.reset_peak_memory(device)
        ro, rewards, sampling = common.rollouts_with_rewards(model, tokenizer, task, batches, dist, args)
        mask = ro.completion_mask * ~ro.truncated[:, None] if args.mask_truncated_completions else ro.completion_mask
        T = mask.shape[1]
        t_gen = time.time() - t0

        # 3. ALGO LOGIC: credit assignment. GRPO gives every token of a completion the same advantage.
        advantages = common.group_advantages(rewards, G, args.scale_rewards, group_ids=ro.group_ids.cpu()).to(device)
        token_adv = advantages[:, None].expand(-1, T)  # [N, T]

        # 4. old and reference log-probs (no gradient). On-policy (one pass, one mini-batch) the old log-probs are the
        #    current ones detached; otherwise only the first optimizer step is on-policy and they need this pass.
        t0 = time.time()
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad():
            on_policy = args.num_iterations == 1 and args.num_minibatches == 1
            old_logp = None if on_policy else common.token_logprobs(model, input_ids, attn, T, args.temperature)[0]
            ref_logp = common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0] if ref_model else None
        t_logp = time.time() - t0

        # 5. update: mu passes; each splits the batch into mini-batches of whole prompts, one optimizer step each,
        #    computed in micro-batches (the loss is normalized over the mini-batch, so accumulation changes nothing)
        t0 = time.time()
        stats = common.UpdateStats(mask, args.num_iterations)
        for it in range(args.num_iterations):
            for rows in common.minibatches(ro.group_ids, args.num_minibatches):
                optimizer.zero_grad(set_to_none=True)
                num_tokens, num_seqs = dist.loss_counts(mask[rows])  # global counts / world size
                micro = rows.split(args.micro_batch_size)
                for k, mb in enumerate(micro):
                    dist.sync_grads(train_model, k == len(micro) - 1)  # all-reduce once per optimizer step
                    m = mask[mb].float()
                    logp, entropy = common.token_logprobs(train_model, input_ids[mb], attn[mb], T, args.temperature, with_entropy=it == 0)
                    old = old_logp[mb] if old_logp is not None else logp.detach()
                    # ALGO LOGIC: PPO-clipped surrogate of the per-token advantage
                    ratio = torch.exp(torch.clamp(logp - old, -common.MAX_LOG_RATIO, common.MAX_LOG_RATIO))  # fp32; clamped as verl
                    A = token_adv[mb]
                    surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high) * A)
                    per_token_loss = -surrogate * engines.engine_correction(ro, mb, old, m, args.vllm_is_cap, stats.engine(it), stats.tokens)  # vLLM: truncated IS
                    kl = common.k3_kl(logp, ref_logp[mb]) if ref_logp is not None else None  # KL(pi || pi_ref), k3 estimator
                    if kl is not None:
                        per_token_loss = per_token_loss + args.beta * kl
                    loss = common.aggregate_loss(per_token_loss, m, args.loss_agg, args.max_new_tokens, num_tokens, num_seqs)
                    common.stop_if_nonfinite(loss, "loss", step, metrics)
                    loss.backward()
                    stats.add(m, ratio, A, args.epsilon, args.epsilon_high, entropy, kl, loss)  # diagnostics
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                common.stop_if_nonfinite(grad_norm, "gradient norm", step, metrics)
                optimizer.step()
                stats.step(grad_norm)
        t_update = time.time() - t0

        # 6. logging, evaluation, checkpoints
        step_time = t_gen + t_logp + t_update
        metrics = {
            **common.completion_metrics(ro, rewards, G), **sampling, **stats.metrics(), "learning_rate": optimizer.param_groups[0]["lr"],
            "tokens_per_second": sampling["num_tokens"] / step_time, "time/generation": t_gen, "time/logprobs": t_logp,
            "time/update": t_update, "time/step": step_time, **common.peak_memory(device),
        }
        if step == args.total_steps or (args.eval_every and step % args.eval_every == 0):
            eval_metrics = common.evaluate(model, tokenizer, task, args.max_new_tokens, args.gen_batch_size, args.eval_temperature, dist)
            metrics.update(eval_metrics)
        metrics = dist.reduce_metrics(metrics)  # eval metrics are already the same on every rank
        logger.log(metrics, step)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", eval_acc=f"{eval_metrics['eval/accuracy']:.3f}")
        stopping = stop.requested(dist)  # Ctrl-C: save and leave after this step
        if ckpt.due(step, args.total_steps) or stopping:
            ckpt.save(step, model, tokenizer, optimizer, batches)
        if stopping:
            logger.close()
            dist.print(f"stopped after step {step}; checkpoint in {run_dir}/checkpoint: continue with --resume {run_dir}")
            raise SystemExit(130)

    logger.close()
    dist.print(f"final eval accuracy {eval_metrics['eval/accuracy']:.3f}; metrics in {run_dir}/metrics.jsonl")
    if args.save_model:
        dist.print(f"saved model to {dist.save(model, tokenizer, run_dir / 'model')}")  # every rank joins the save
    dist.close()
