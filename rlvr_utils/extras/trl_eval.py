"""--eval-num-generations G, an extra: the evaluation as TRL's GRPOTrainer makes it (docs/trl.md). TRL samples
`num_generations_eval` completions per eval prompt at its training temperature and logs the training metrics of them
under `eval_` (eval_reward, eval_reward_std, eval_frac_reward_zero_std, eval_completions/mean_length, ...); here the
same samples (at --eval-temperature, or --temperature as TRL) give the training metrics' names under `eval/`
(runtime.completion_metrics: the same code as a training step's), and eval/accuracy the share of the samples whose
reward reaches --success-threshold (an unscored one is not a success). The default evaluation stays the greedy pass@1
(common.evaluate): eval/accuracy there is the share of prompts whose one greedy completion succeeds.
"""

from __future__ import annotations

import types

import torch

from rlvr_utils.core.runtime import completion_metrics


def metrics(task, ro, rewards: list, G: int, threshold: float, dist, num_prompts: int) -> dict:
    """The evaluation's metrics (with the --reward-fn functions' own, task.with_reward_metrics) from this rank's
    samples: `ro`, the Rollouts of its slice of the eval prompts (G rows
    each; rows past `rewards` are the padding of an equal slice, not counted) and `rewards`, one per counted row (NaN:
    unscored). Under torchrun each rank's rows are placed in one vector of all `num_prompts` x G and summed, so that
    every rank computes the figures of every sample, as TRL gathers them."""
    n = len(rewards)  # this rank's counted rows
    offset = dist.rank * -(-num_prompts // dist.world) * G if dist is not None else 0
    lengths = ro.completion_mask[:n].sum(1).float().cpu()
    columns = [torch.tensor(rewards, dtype=torch.float64), lengths.double(), ro.truncated[:n].double().cpu()]
    total = torch.zeros(3, num_prompts * G, dtype=torch.float64)
    total[:, offset : offset + n] = torch.stack(columns)
    if dist is not None:  # the other ranks' places are 0 here, so the sum is every rank's rows
        total = torch.tensor(dist.sum(total.flatten().tolist()), dtype=torch.float64).view(3, -1)
    r, lengths, truncated = total[0].float(), total[1], total[2].bool()
    every = types.SimpleNamespace(  # the fields completion_metrics reads, of every sample (mask: one column of lengths)
        completion_mask=lengths[:, None], group_ids=torch.arange(len(r)) // G, scores=None, truncated=truncated
    )
    out = {f"eval/{k}": v for k, v in completion_metrics(every, r, G, threshold).items()}
    out["eval/accuracy"] = (r >= threshold).float().mean().item()  # NaN (unscored) is no success
    return task.with_reward_metrics(out, mode="eval")
