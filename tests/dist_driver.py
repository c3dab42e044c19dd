"""Run one of the scripts in this process (under torchrun or not) and save this rank's parameters.

    [torchrun --nproc_per_node 2] python tests/dist_driver.py OUT_DIR [--fixed] SCRIPT ARGS...

--fixed replaces generation with fixed completions (a deterministic function of the prompt and the
sample index: right, wrong, or cut short), so runs with different world sizes train on the same data.
Parameters, and the gradients the first optimizer step saw, go to OUT_DIR/world<W>_rank<R>.pt (Adam's
first step is nearly lr * sign(gradient), so the gradients are the sensitive comparison)."""

import os
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from rlvr_utils.core import checkpoints, logprob_kernels, tasks  # noqa: E402
from rlvr_utils.extras.scale import distributed  # noqa: E402


def fixed_rollouts(model, tokenizer, prompts, group_ids, num_generations, max_new_tokens, *args, **kwargs):
    flat, texts = [], []
    for p, g in zip(prompts, group_ids):
        problem = tasks.parse_arith_problem(tokenizer.decode(p).split("Solve:")[-1])
        for j in range(num_generations):  # lengths differ by prompt, so ranks hold different token counts
            right = "x\n" * (g % 7) + problem.solution()
            texts.append([right, right.replace("####", "#### 1"), right.split("\n")[0]][(g + j) % 3])
            flat.append((list(p), g))
    eos = tokenizer.eos_token_id
    comps = [tokenizer(t, add_special_tokens=False).input_ids[: max_new_tokens - 1] + [eos] for t in texts]
    device = next(model.parameters()).device
    return common.make_rollouts(
        tokenizer, [p for p, _ in flat], comps, [g for _, g in flat], common.stop_token_ids(model, tokenizer), device
    )


_generate = common.generate_rollouts
FIRST_GRADS = {}
_step = torch.optim.AdamW.step


def recording_step(self, *args, **kwargs):
    if not FIRST_GRADS:
        for i, p in enumerate(q for group in self.param_groups for q in group["params"]):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            FIRST_GRADS[i] = grad.detach().cpu().clone()
    return _step(self, *args, **kwargs)


torch.optim.AdamW.step = recording_step
IDLE = {"passes": 0, "teacher": 0}  # FSDP's padding on this rank: idle micro-batches, idle teacher forwards
_idle, _idle_forward = distributed.TorchrunDist.idle_pass, distributed.TorchrunDist.idle_forward


def counting_idle(self, train_model):
    IDLE["passes"] += 1
    return _idle(self, train_model)


def counting_idle_forward(self, busy, forward):
    def counted():
        IDLE["teacher"] += 1
        return forward()

    return _idle_forward(self, busy, counted)


distributed.TorchrunDist.idle_pass, distributed.TorchrunDist.idle_forward = counting_idle, counting_idle_forward

if __name__ == "__main__":
    out, rest = Path(sys.argv[1]), sys.argv[2:]
    if rest[0] == "--fixed":
        common.generate_rollouts = fixed_rollouts
        rest = rest[1:]
    if os.environ.get("DRIVER_LOCAL_COUNTS"):  # the bug the equivalence test must catch: per-rank normalization
        distributed.TorchrunDist.loss_counts = lambda self, mask, num_seqs=None: (mask.sum().item(), len(mask))
    if os.environ.get("DRIVER_DIE_AT_STEP") and os.environ.get("RANK") == "1":  # rank 1 dies in its first rollout
        common.generate_rollouts = lambda *a, **k: os._exit(3) if k.get("do_sample", True) else _generate(*a, **k)
    if os.environ.get("DRIVER_FIRST_CHOICE"):  # SC-GRPO's routing draws (torch.randint with its generator) take the
        _randint = torch.randint  # first candidate, so that 1 and 2 ranks route alike whatever the group order

        def first_choice(*a, **k):
            return torch.zeros(a[1], dtype=torch.long) if "generator" in k else _randint(*a, **k)

        torch.randint = first_choice
    if os.environ.get("DRIVER_BAD_FLAGS") and os.environ.get("RANK") == "1":
        rest = rest + ["--learning-rate", "0.5"]  # rank 1 disagrees with rank 0
    close, distributed.TorchrunDist.close = (
        distributed.TorchrunDist.close,
        lambda self, *a, **k: None,
    )  # keep the group for the FSDP gather below
    sys.argv = [str(ROOT / rest[0]), *rest[1:]]
    g = runpy.run_path(str(ROOT / rest[0]), run_name="__main__")
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    model = g["model"]
    with checkpoints.masters_of(model):  # mixed precision: the fp32 masters
        state = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
            for k, v in model.state_dict().items()
        }
    out.mkdir(parents=True, exist_ok=True)
    fused = logprob_kernels.fused_logprobs_ok(g["train_model"])  # which log-prob path the loss took
    ro = g.get("ro")  # the last step's rows and the per-token advantages that reached its loss (batch statistics)
    adv = g.get("token_adv")
    adv = adv * g["weights"] if adv is not None and "weights" in g else adv  # SC-GRPO: f times the advantage
    rows = {"gid": ro.group_ids.cpu(), "adv": adv.detach().cpu(), "mask": g["mask"].cpu()} if adv is not None else None
    torch.save(
        {"params": state, "grads": FIRST_GRADS, "fused": fused, "idle": IDLE, "rows": rows},
        out / f"world{world}_rank{rank}.pt",
    )
    close(g["dist"], then_exit=True)
