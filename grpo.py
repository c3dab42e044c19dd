"""GRPO: group-relative policy optimization, the baseline every method here is measured against.

For each prompt, sample G completions, score them with a verifiable reward, and give every token of
a completion the same advantage: its reward minus the group's mean, divided by the group's std.
The policy maximizes a PPO-clipped surrogate of that advantage, optionally with a k3 KL penalty to
a frozen reference. Flags reproduce the common variants: DAPO (token-mean, clip-higher) and
Dr. GRPO (no std scaling, constant-length normalization).
Paper: Shao et al. 2024, DeepSeekMath (arXiv 2402.03300). Docs: README.md.

    python grpo.py                                              # bundled tiny model, built-in task, CPU
    python grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --learning-rate 1e-6 --max-new-tokens 512
"""

import copy
import dataclasses
import time
from pathlib import Path

import torch
import tyro
from tqdm import trange

import common
import distributed
import engines
import tasks


@dataclasses.dataclass
class Args:
    exp_name: str = "grpo"
    """name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment (prompts, sampling, initialization)"""
    track: bool = False
    """log to Weights & Biases as well as TensorBoard"""
    wandb_project: str = "credit-rlvr"
    """wandb project name (with --track)"""
    output_dir: str = "runs"
    """logs, metrics.jsonl and checkpoints go to <output-dir>/<run-name>/"""
    save_model: bool = False
    """save the final policy as a Hugging Face directory <output-dir>/<run-name>/model (atomic write)"""
    device: str = "auto"
    """cuda when available, else cpu"""
    dtype: str = "auto"
    """model dtype: auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16, float16"""

    # model and task
    model: str = common.DEFAULT_MODEL
    """Hugging Face hub id or local directory of the policy; the default is the bundled tiny model"""
    task: str = "arith"
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
    """optimizer steps of the run (each samples a new batch of prompts)"""
    prompts_per_step: int = 8
    """prompts per step (the global batch: across all torchrun ranks, divisible by their number); each gets --num-generations completions"""
    num_generations: int = 8
    """G: completions per prompt (the group)"""
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

    # optimization
    learning_rate: float = 1e-4
    """AdamW learning rate (constant). The default suits the tiny model; use ~1e-6 for 1B+ models"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    num_iterations: int = 1
    """mu: optimizer passes over each batch (1 = on-policy: the ratio is exactly 1)"""
    epsilon: float = 0.2
    """lower clip: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]"""
    epsilon_high: float | None = None
    """upper clip (DAPO's clip-higher uses 0.28); default: same as --epsilon"""
    beta: float = 0.0
    """k3 KL coefficient to the frozen initial policy (0: no reference model is loaded)"""
    loss_agg: str = "seq-mean-token-mean"
    """token-mean (DAPO), seq-mean-token-mean (original GRPO), seq-mean-token-sum-norm (Dr. GRPO)"""
    scale_rewards: str = "group"
    """advantage scaling: group std (GRPO), batch std (Lite PPO) or none (Dr. GRPO)"""
    micro_batch_size: int = 16
    """sequences per forward/backward (gradient accumulation; the loss is normalized over the whole batch)"""
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
    engine: str = "auto"
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


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.epsilon_high is None:
        args.epsilon_high = args.epsilon
    run_name = f"{args.task}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir = Path(args.output_dir) / run_name

    # seeding, model, task
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
    engines.attach_engine(args.engine, model, optimizer, args.model, args.vllm_gpu_memory_utilization, seed=args.seed + dist.rank)
    logger = common.Logger(run_dir, vars(args), args.track, args.wandb_project, enabled=dist.main)
    dist.print(f"run {run_name}: logs in {run_dir}/ (tensorboard --logdir {args.output_dir}); "
               f"{len(task.train)} train / {len(task.eval)} eval prompts; skipped {task.skipped}")
    batches = common.prompt_batches(task.train, args.prompts_per_step, args.seed)
    G = args.num_generations

    eval_metrics = common.evaluate(model, tokenizer, task, args.max_new_tokens, args.gen_batch_size, args.eval_temperature, dist)
    logger.log(eval_metrics, 0)
    metrics = dict(eval_metrics)
    bar = trange(1, args.total_steps + 1, desc="grpo", dynamic_ncols=True, disable=not dist.main)
    for step in bar:
        # 1. rollouts: G completions per prompt
        t0 = time.time()
        common.reset_peak_memory(device)
        examples = dist.shard(next(batches))
        ro = common.generate_rollouts(
            model, tokenizer, [e.prompt_ids for e in examples], [e.id for e in examples], G, args.max_new_tokens,
            args.temperature, args.top_p, args.top_k, batch_size=args.gen_batch_size,
        )
        t_gen = time.time() - t0

        # 2. rewards, one per completion (the verifier sees the decoded text)
        rewards = torch.tensor(task.rewards(ro.texts, [e for e in examples for _ in range(G)]))
        mask = ro.completion_mask
        T = mask.shape[1]

        # 3. ALGO LOGIC: credit assignment. GRPO gives every token of a completion the same advantage.
        advantages = common.group_advantages(rewards, G, args.scale_rewards, group_ids=ro.group_ids.cpu()).to(device)
        token_adv = advantages[:, None].expand(-1, T)  # [N, T]

        # 4. old and reference log-probs (no gradient). With mu = 1 the old log-probs are the current
        #    ones detached, so no extra forward pass is needed.
        t0 = time.time()
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad():
            old_logp = common.token_logprobs(model, input_ids, attn, T, args.temperature)[0] if args.num_iterations > 1 else None
            ref_logp = common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0] if ref_model else None
        t_logp = time.time() - t0

        # 5. update: mu passes, each one optimizer step over the whole batch in micro-batches
        t0 = time.time()
        N, (num_tokens, num_seqs) = len(ro), dist.loss_counts(mask)  # global counts / world size
        stats = {k: 0.0 for k in ("policy_loss", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")}
        for it in range(args.num_iterations):
            optimizer.zero_grad(set_to_none=True)
            for s in range(0, N, args.micro_batch_size):
                mb = slice(s, s + args.micro_batch_size)
                dist.sync_grads(train_model, s + args.micro_batch_size >= N)
                m = mask[mb].float()
                logp, entropy = common.token_logprobs(train_model, input_ids[mb], attn[mb], T, args.temperature, with_entropy=it == 0)
                old = old_logp[mb] if old_logp is not None else logp.detach()
                # ALGO LOGIC: PPO-clipped surrogate of the per-token advantage
                ratio = torch.exp(torch.clamp(logp - old, -common.MAX_LOG_RATIO, common.MAX_LOG_RATIO))  # fp32; clamped as verl
                A = token_adv[mb]
                surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high) * A)
                per_token_loss = -surrogate * engines.engine_correction(ro, mb, old, m, args.vllm_is_cap, stats if it == 0 else None, num_tokens)  # vLLM: truncated IS
                if ref_logp is not None:  # k3 estimator of KL(pi || pi_ref)
                    kl = common.k3_kl(logp, ref_logp[mb])
                    per_token_loss = per_token_loss + args.beta * kl
                    stats["kl"] += ((kl * m).sum() / num_tokens).item() / args.num_iterations
                loss = common.aggregate_loss(per_token_loss, m, args.loss_agg, args.max_new_tokens, num_tokens, num_seqs)
                common.stop_if_nonfinite(loss, "loss", step, metrics)
                loss.backward()
                # diagnostics
                low = ((ratio < 1 - args.epsilon) & (A < 0)).float()
                high = ((ratio > 1 + args.epsilon_high) & (A > 0)).float()
                stats["policy_loss"] += loss.item() / args.num_iterations
                stats["clip_ratio/low_mean"] += ((low * m).sum() / num_tokens).item() / args.num_iterations
                stats["clip_ratio/high_mean"] += ((high * m).sum() / num_tokens).item() / args.num_iterations
                stats["clip_ratio/region_mean"] += (((low + high) * m).sum() / num_tokens).item() / args.num_iterations
                if entropy is not None:
                    stats["entropy"] += ((entropy * m).sum() / num_tokens).item()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            common.stop_if_nonfinite(grad_norm, "gradient norm", step, metrics)
            optimizer.step()
        t_update = time.time() - t0

        # 6. logging and evaluation
        step_time = t_gen + t_logp + t_update
        metrics = {
            **common.completion_metrics(ro, rewards, G), **stats,
            "grad_norm": grad_norm.item(), "learning_rate": optimizer.param_groups[0]["lr"],
            "tokens_per_second": num_tokens / step_time, "num_tokens": num_tokens,
            "time/generation": t_gen, "time/logprobs": t_logp, "time/update": t_update, "time/step": step_time,
            **common.peak_memory(device),
        }
        if ref_model is None:
            metrics.pop("kl")
        if step == args.total_steps or (args.eval_every and step % args.eval_every == 0):
            eval_metrics = common.evaluate(model, tokenizer, task, args.max_new_tokens, args.gen_batch_size, args.eval_temperature, dist)
            metrics.update(eval_metrics)
        metrics = dist.reduce_metrics(metrics)  # eval metrics are already the same on every rank
        logger.log(metrics, step)
        bar.set_postfix(reward=f"{metrics['reward']:.3f}", eval_acc=f"{eval_metrics['eval/accuracy']:.3f}")

    logger.close()
    dist.print(f"final eval accuracy {eval_metrics['eval/accuracy']:.3f}; metrics in {run_dir}/metrics.jsonl")
    if args.save_model:
        dist.print(f"saved model to {dist.save(model, tokenizer, run_dir / 'model')}")  # every rank joins the save
    dist.close()
