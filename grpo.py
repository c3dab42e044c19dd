"""GRPO: group-relative policy optimization, the baseline every method here is measured against.

For each prompt, sample G completions, score them with a verifiable reward, and give every token
of a completion the same advantage: its reward minus the group's mean, divided by the group's std.
The policy maximizes a PPO-clipped surrogate of that advantage, optionally with a k3 KL penalty to
a frozen reference. Flags reproduce the common variants: DAPO (token-mean, clip-higher, dynamic
sampling, overlong shaping, several mini-batch steps per batch) and Dr. GRPO (no std scaling,
constant-length normalization).
Paper: Shao et al. 2024, DeepSeekMath (arXiv 2402.03300). Docs: README.md, docs/grpo_variants.md.

    python grpo.py                              # bundled tiny model, built-in task, CPU
    python grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --task gsm8k --learning-rate 1e-6 \\
        --max-new-tokens 512 --gradient-checkpointing
"""

import dataclasses

import torch

import common
from rlvr_utils.core import cli


@dataclasses.dataclass
class Args(cli.BaseArgs):
    """GRPO: the shared flags only (rlvr_utils/core/cli.py: run, model, task, sampling, optimizer,
    evaluation, engine, torchrun)."""


if __name__ == "__main__":
    # TRY NOT TO MODIFY: flags, torchrun, seeding; the task, the model, its reference, the optimizer
    args = cli.parse(Args)  # tyro.cli(Args), every check before anything loads (one-line errors)
    run = common.Run(args)
    tokenizer = common.load_tokenizer(args.model)
    task = common.load_task(args, tokenizer)  # before the model: an empty task stops at once
    model = common.load_model(args.model, run.device, run.dtype, args.gradient_checkpointing)
    model = common.with_lora(model, args)  # --lora-rank: LoRA adapters train, the base is frozen
    ref_model = common.reference(model, args) if args.beta > 0 else None  # LoRA: adapters off
    train_model = run.dist.wrap(model, ref_model)  # DDP / FSDP2; bf16: fp32 masters (precision.py)
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    optimizer = common.adamw(params, args)  # mixed precision: it steps the fp32 masters
    run.start(model, tokenizer, optimizer, task)  # batches, --resume, vLLM, logs, step-0 eval
    dist = run.dist
    G = args.num_generations

    for step in run.steps():
        # 1-2. rollouts: G completions per prompt, one reward per completion (the verifier sees the
        #      decoded text); DAPO's dynamic sampling and overlong penalty when asked
        ro, rewards, sampling = common.rollouts_with_rewards(
            model, tokenizer, task, run.batches, dist, args
        )
        mask = ro.completion_mask  # [N, T]
        if args.mask_truncated_completions:  # DAPO's overlong filtering
            mask = mask * ~ro.truncated[:, None]
        T = mask.shape[1]
        run.lap("generation")

        # 3. ALGO LOGIC: credit assignment. GRPO gives every token of a completion the same
        #    advantage. torchrun: over the global batch (--scale-rewards batch: its std).
        gid = ro.group_ids.cpu()
        advantages = dist.over_global_batch(
            common.group_advantages, rewards, G, args.scale_rewards, group_ids=gid
        )  # [N]
        token_adv = advantages.to(run.device)[:, None].expand(-1, T)  # [N, T]

        # 4. old and reference log-probs (no gradient). On-policy (one pass, one mini-batch) the
        #    old log-probs are the current ones, detached; otherwise this pass makes them.
        input_ids, attn = ro.input_ids, ro.attention_mask
        with torch.no_grad(), dist.gathered_if_uneven(model, ref_model):  # FSDP, uneven rows
            on_policy = args.num_iterations == 1 and args.num_minibatches == 1
            old_logp = None
            if not on_policy:
                old_logp = common.token_logprobs(model, input_ids, attn, T, args.temperature)[0]
            ref_logp = None
            if ref_model is not None:
                ref_logp = common.token_logprobs(ref_model, input_ids, attn, T, args.temperature)[0]
        run.lap("logprobs")

        # 5. update: mu passes; each splits the batch into mini-batches of whole prompts, one
        #    optimizer step each, in micro-batches (the loss is normalized over the mini-batch)
        stats = common.UpdateStats(mask, args.num_iterations)
        for it in range(args.num_iterations):
            for rows in common.minibatches(ro.group_ids, args.num_minibatches):
                optimizer.zero_grad(set_to_none=True)
                num_tokens, num_seqs = dist.loss_counts(mask[rows])  # global counts / world size
                agg = (args.loss_agg, args.max_new_tokens, num_tokens, num_seqs)
                micro = rows.split(args.micro_batch_size)
                for mb in dist.micro_batches(train_model, micro):  # all-reduce in the last
                    m = mask[mb].float()
                    batch = (input_ids[mb], attn[mb], T, args.temperature)
                    logp, entropy = common.token_logprobs(train_model, *batch, with_entropy=it == 0)
                    run.watch_credit(logp, mb, m, num_tokens, num_seqs)  # LOGS: --log-credit
                    old = old_logp[mb] if old_logp is not None else logp.detach()
                    # ALGO LOGIC: PPO-clipped surrogate of the per-token advantage
                    log_ratio = (logp - old).clamp(-common.MAX_LOG_RATIO, common.MAX_LOG_RATIO)
                    ratio = torch.exp(log_ratio)
                    A = token_adv[mb]
                    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)
                    surrogate = torch.min(ratio * A, clipped * A)
                    per_token_loss = -surrogate
                    # vLLM rollouts: importance weights toward the engine's sampling (HF: 1)
                    engine_w = common.engine_correction(ro, mb, old, m, args, stats, it)
                    per_token_loss = per_token_loss * engine_w
                    kl = None  # KL(pi || pi_ref), k3, with --beta > 0
                    if ref_logp is not None:
                        kl = common.k3_kl(logp, ref_logp[mb])
                        per_token_loss = per_token_loss + args.beta * kl
                    loss = common.aggregate_loss(per_token_loss, m, *agg)
                    run.stop_if_nonfinite(loss, "loss")
                    loss.backward()
                    stats.add(m, ratio, A, args.epsilon, args.epsilon_high, entropy, kl, loss)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                run.stop_if_nonfinite(grad_norm, "gradient norm")
                optimizer.step()
                stats.step(grad_norm)
        run.lap("update")

        # 6. TRY NOT TO MODIFY: metrics, evaluation, logging, checkpoint, Ctrl-C
        run.end_step(step, ro, rewards, stats, sampling)

    run.finish()
