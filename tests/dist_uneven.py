"""Ranks with different numbers of micro-batches (2 on rank 0, 1 on rank 1) under torchrun, with DDP or FSDP:

    torchrun --nproc_per_node 2 tests/dist_uneven.py OUT_DIR ddp|fsdp

Under FSDP with uneven rows (Dist.uneven, SRPO's) rank 1 runs an idle pass (Dist.micro_batches) so the collectives
match; the gradient must be the one DDP gives, where rank 1 simply runs one micro-batch. Rank 0 saves the full gradient
to OUT_DIR/<mode>.pt."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
from rlvr_utils.core import runtime  # noqa: E402

if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), sys.argv[2]
    dist, device = runtime.init_distributed("cpu", {}, 2, 120, fsdp=mode == "fsdp")
    torch.manual_seed(0)
    model = common.load_model(common.DEFAULT_MODEL, device)
    train = dist.wrap(model)
    g = torch.Generator().manual_seed(1 + dist.rank)
    ids = torch.randint(3, 50, (2 if dist.rank == 0 else 1, 12), generator=g)  # rank 0: two micro-batches of one row
    attn, T = torch.ones_like(ids), 6
    dist.uneven = True  # ranks hold different numbers of rows, as SRPO's
    micro = [torch.tensor([k]) for k in range(len(ids))]  # one row each: rank 1 has one fewer
    for mb in dist.micro_batches(train, micro):  # its missing one: an idle pass (FSDP)
        (-common.token_logprobs(train, ids[mb], attn[mb], T)[0].sum() / 3).backward()
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in model.named_parameters()
    }
    if dist.main:
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"grads": grads, "n": len(micro), "rank1_rows": 1}, out / f"{mode}.pt")
    dist.close(then_exit=True)
