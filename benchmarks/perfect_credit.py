"""The positive control of the learning benchmarks: grpo.py with perfect process credit (a benchmark, not a method).

"Perfect process credit" here is first-error credit on failed completions only: in a failed completion only the
first wrong line and what follows get its (negative) GRPO advantage; the correct prefix before it gets 0. Correct
completions are GRPO's, a wrong intermediate line in one included. The built-in arith task knows the first wrong line
(tasks.arith_first_error; a completion that stops early is wrong at its first missing line, so only its stop token is
blamed; one cut off by the token cap with every line right has nothing to blame: all its tokens get 0). A setting
where this control does not beat GRPO cannot reward credit assignment, whatever a method does (docs/benchmarks.md, "A
positive control"). `--placebo` is its mass-matched placebo (placebo_credit): each failed row keeps the control's
total |advantage|, spread over all its tokens, so the control minus the placebo measures where blame goes apart from
how much. Everything else is grpo.py's loop, line for line (tests/test_shared_loop.py).

    python benchmarks/perfect_credit.py                     # arith only; the other flags are grpo.py's
    python benchmarks/perfect_credit.py --placebo           # the mass-matched placebo (placebo_credit)
    python benchmarks/learning_curves.py run --setting long --methods grpo control --seeds 1 2 3
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # common.py and rlvr_utils/ beside benchmarks/
import common  # noqa: E402
from rlvr_utils.core import cli, tasks  # noqa: E402
from rlvr_utils.methods import chains  # noqa: E402


@dataclasses.dataclass
class Args(cli.BaseArgs):
    """grpo.py's flags; --task arith only (its first wrong line is known)."""

    placebo: bool = False
    """the mass-matched placebo instead of the control: each failed completion's advantage times the share of its
    tokens the control blames, on every token (the same total |advantage| per row, no location: placebo_credit)"""


def blame_from(tokenizer, example, ids: list[int], text: str) -> int:
    """The index of the first token of `text` (sampled ids `ids`) on or after the start of its first wrong line: the
    tokens before it are the correct prefix (a token straddling the line start is blamed)."""
    k = tasks.arith_first_error(example.question, text)
    if k is None:  # every line right: nothing to spare
        return 0
    starts = [i for i, line in enumerate(text.split("\n")) if line.strip()]  # non-empty lines, as the oracle counts
    offsets = [sum(len(x) + 1 for x in text.split("\n")[:i]) for i in starts]
    if k > len(offsets):  # stopped early, every line right: the stop token is the error (none: nothing blamed)
        return len(ids) - 1 if ids and ids[-1] in tokenizer.all_special_ids else len(ids)
    return chains.tokens_before(tokenizer, ids, offsets[k - 1])


def failed_rows(ro, success, examples, tokenizer):
    """Each failed completion: its row, its number of tokens n and blame_from's first blamed token."""
    for i in torch.nonzero(~success).flatten().tolist():
        n = int(ro.completion_mask[i].sum())
        ids = ro.completion_ids[i, :n].tolist()
        yield i, n, blame_from(tokenizer, examples[int(ro.group_ids[i])], ids, ro.texts[i])


def perfect_credit(advantages, ro, success, examples, tokenizer) -> torch.Tensor:
    """[N, T] per-token advantages: GRPO's [N] broadcast, with each failed completion's correct prefix set to 0."""
    T = ro.completion_ids.shape[1]
    token_adv = advantages[:, None].expand(-1, T).clone()
    for i, _, start in failed_rows(ro, success, examples, tokenizer):
        token_adv[i, :start] = 0.0
    return token_adv


def placebo_credit(advantages, ro, success, examples, tokenizer) -> torch.Tensor:
    """[N, T] per-token advantages of the mass-matched placebo: GRPO's [N] broadcast, each failed completion's scaled
    on all its tokens by the share the control blames, (n - start) / n (n its tokens, start: blame_from's first blamed
    token). Each row keeps the control's total |advantage| (perfect_credit zeroes `start` of its n tokens), spread
    evenly, so the control minus this placebo is where the blame goes, apart from how much of it there is. (A zeroed
    random span of `start` tokens would match the mass too, but with first wrong lines late in a row, a span that long
    overlaps the correct prefix by at least 2 start - n tokens: mostly the control itself.)"""
    T = ro.completion_ids.shape[1]
    token_adv = advantages[:, None].expand(-1, T).clone()
    for i, n, start in failed_rows(ro, success, examples, tokenizer):
        token_adv[i] *= (n - start) / max(n, 1)
    return token_adv


# fmt: off
if __name__ == "__main__":
    # TRY NOT TO MODIFY: flags, torchrun, seeding; the task, the model, its reference, the optimizer
    args = cli.parse(Args)  # tyro.cli(Args), every check before anything loads (one-line errors)
    cli.need(args.task == "arith", "perfect_credit.py needs --task arith (its first wrong line is known)")
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
    by_id = {e.id: e for e in task.train}

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
        # CONTROL: perfect process credit (each failed completion's correct prefix gets 0);
        # --placebo: the same |advantage| per failed row, spread over all its tokens
        success = ro.scores >= args.success_threshold
        token_adv = perfect_credit(advantages, ro, success, by_id, tokenizer).to(run.device)  # [N, T]
        spared = (token_adv == 0) & (advantages[:, None] != 0).to(run.device) & mask.bool()
        sampling["control/spared_token_share"] = float(spared.sum() / mask.sum())
        if args.placebo:
            token_adv = placebo_credit(advantages, ro, success, by_id, tokenizer).to(run.device)

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
# fmt: on
