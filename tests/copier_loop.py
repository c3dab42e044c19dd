"""A copier's own training loop with one method's credit (docs/conventions.md, "Copy a method's credit into your own
loop"): plain transformers on the bundled tiny model, its own prompts, sampling, rewards, log-probs and optimizer; only
the credit function comes from the method's file, imported from the minimal copy this file sits in. Nothing of the
project's loop (common.Run, rollouts, UpdateStats) runs. Two optimizer steps, then one RESULT line (JSON): the losses,
the parameters' change, the method module's file and the project files it loaded. tests/test_copier.py runs it.

    python copier_loop.py sc_grpo    # or grpo_lambda, ep_grpo: in a folder holding that script's minimal copy
"""

import json
import os
import re
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

METHOD = sys.argv[1]
PROMPTS = [("Solve: 3+4-2\n", 5), ("Solve: 7+1-5\n", 3), ("Solve: 2+2+1\n", 5), ("Solve: 9-3+4\n", 10)]  # equal lengths
G, T, STEPS, EPS = 4, 24, 2, 0.2  # completions per prompt, new tokens, optimizer steps, the clip

torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained("assets/tiny-arith")
policy = AutoModelForCausalLM.from_pretrained("assets/tiny-arith", dtype=torch.float32)
ref = AutoModelForCausalLM.from_pretrained("assets/tiny-arith", dtype=torch.float32).eval().requires_grad_(False)
start = [p.detach().clone() for p in policy.parameters()]
optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4, weight_decay=0.0)  # the change is the gradient's


def reward(text: str, answer: int) -> float:
    """1.0 when the last `#### N` is the answer."""
    found = re.findall(r"####\s*(-?\d+)", text)
    return float(bool(found) and int(found[-1]) == answer)


def token_logits(model, ids: torch.Tensor, P: int) -> torch.Tensor:
    """The logits that predict each completion token [b, T, V] (the tiny vocabulary of 99 allows [b, T, V])."""
    return model(input_ids=ids).logits[:, P - 1 : -1].float()


def logprobs(logits: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, completion[..., None])[..., 0]


if METHOD == "sc_grpo":
    from sc_grpo import Role, SCConfig, build_teachers, route_groups, token_kl, weighted_tokens, weights_and_advantages

    cfg = SCConfig()
elif METHOD == "grpo_lambda":
    from grpo_lambda import LambdaConfig, clamp_negative_advantages, grpo_lambda_token_loss

    cfg = LambdaConfig()
elif METHOD == "ep_grpo":
    from ep_grpo import EPConfig, ep_advantages

    cfg = EPConfig()
else:
    raise SystemExit(f"unknown method {METHOD!r}: sc_grpo, grpo_lambda or ep_grpo")


def sc_credit(step, logits, completion, mask, texts, rewards, adv):
    """SC-GRPO's weights f and advantages [N, T]: the copier's own teacher prompt (a correct sibling's text before
    its problem), D = KL(teacher || student) per token from the policy's logits with and without it (no gradient)."""
    gid, correct = torch.arange(len(texts)) // G, rewards >= 1.0
    modes, tau_row = route_groups(correct, G, torch.Generator().manual_seed(step), gid)
    make = lambda i, tau: tok(f"Reference solution:\n{tau}\n{PROMPTS[i // G][0]}").input_ids  # noqa: E731
    limit = policy.config.max_position_embeddings - T
    teachers = build_teachers(tok, make, texts, mask, gid, correct, tau_row, limit, 8192, torch.Generator())
    D = torch.zeros_like(mask)
    with torch.no_grad():
        for i, prompt in enumerate(teachers.prompts):
            if prompt is not None:
                teacher_ids = torch.cat([torch.tensor([prompt]), completion[i : i + 1]], 1)
                D[i] = token_kl(token_logits(policy, teacher_ids, len(prompt))[0], logits[i].detach())
    active = weighted_tokens(mask, teachers.role, teachers.wlen)
    weights, A, f = weights_and_advantages(D, active, teachers.role, gid, adv[:, None].expand(-1, T).clone(), cfg)
    on, plain = active.bool(), teachers.role == Role.PLAIN
    f_range = [f[on].min().item(), f[on].max().item()] if on.any() else None
    sc.append(dict(partial=modes.count("partial"), f=f_range, plain_weights_one=bool((weights[plain] == 1).all())))
    return weights, A


sc, losses = [], []
for step in range(STEPS):
    prompts = tok([p for p, _ in PROMPTS], return_tensors="pt").input_ids  # [4, P], no padding
    P = prompts.shape[1]
    with torch.no_grad():  # sampling: T tokens each, EOS does not stop it; the mask ends at the first EOS
        ids = policy.generate(prompts.repeat_interleave(G, 0), do_sample=True, max_new_tokens=T, min_new_tokens=T,
                              eos_token_id=None, pad_token_id=tok.pad_token_id)  # fmt: skip
    completion = ids[:, P:]
    is_eos = completion == tok.eos_token_id
    mask = ((is_eos.cumsum(1) - is_eos.long()) == 0).float()  # up to and including the first EOS
    texts = [tok.decode(c[m.bool()], skip_special_tokens=True) for c, m in zip(completion, mask)]
    rewards = torch.tensor([reward(t, PROMPTS[i // G][1]) for i, t in enumerate(texts)])
    r = rewards.view(-1, G)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()  # the copier's own advantage

    logits = token_logits(policy, ids, P)
    logp = logprobs(logits, completion)  # [N, T], with the gradient
    if METHOD == "sc_grpo":  # the copier's clipped surrogate of SC-GRPO's advantages, times the weight f
        weights, A = sc_credit(step, logits, completion, mask, texts, rewards, adv)
        ratio = torch.exp(logp - logp.detach())
        per_token = -torch.min(ratio * A, torch.clamp(ratio, 1 - EPS, 1 + EPS) * A) * weights
    elif METHOD == "grpo_lambda":  # the traced ratio inside the clipped surrogate (the method's loss)
        A = clamp_negative_advantages(adv, cfg.adv_floor)[:, None].expand(-1, T)
        per_token = grpo_lambda_token_loss(logp, logp.detach(), A, mask, cfg).loss
    else:  # per-token advantages from the entropy and the reference, then the copier's clipped surrogate
        with torch.no_grad():
            H = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
            ref_logp = logprobs(token_logits(ref, ids, P), completion)
        A = ep_advantages(H, logp.detach(), ref_logp, mask, rewards, G, cfg=cfg)
        ratio = torch.exp(logp - logp.detach())
        per_token = -torch.min(ratio * A, torch.clamp(ratio, 1 - EPS, 1 + EPS) * A)
    loss = (per_token * mask).sum() / mask.sum()  # token mean
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    print(f"step {step + 1}: loss {loss.item():.6f}, reward {rewards.mean().item():.3f}", flush=True)

here = os.path.abspath(".")
files = {os.path.abspath(f) for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None))}
change = torch.sqrt(sum(((p.detach() - s) ** 2).sum() for p, s in zip(policy.parameters(), start)))
result = dict(losses=losses, change=change.item(), module=os.path.abspath(sys.modules[METHOD].__file__), sc=sc)
result["loaded"] = sorted(os.path.relpath(f, here) for f in files if f.startswith(here + os.sep) and os.path.isfile(f))
print("RESULT " + json.dumps(result))
