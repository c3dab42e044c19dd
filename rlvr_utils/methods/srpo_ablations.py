"""SRPO's ablations (docs/srpo.md, Ablations), an extra: their flags join srpo.py's when one is given (cli.parse;
`--help` with one of them lists them all), and srpo.py then calls these where its method would do otherwise: the
split of the budget (`split_sizes`, `fallback`), the tokens that train (`trained`) and the surrogate (`surrogate`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from rlvr_utils.core import cli

DUAL_CLIP = 3.0  # --clip: verl's dual-clip constant in the official srpo_clip loss (loss <= -3A)


@dataclasses.dataclass
class Ablations:
    """SRPO's ablation flags (docs/srpo.md, Ablations)."""

    split: Literal["1x4", "2x4", "1x8"] = "1x4"
    """1x4 (the method's): 4 fresh + 4 suffixes of one parent; 2x4: 2 parents x 4 suffixes; 1x8: 1
    parent x 8"""
    clip: bool = False
    """PPO-clipped surrogate with dual-clip 3 instead of plain REINFORCE; the official ablation also
    used --loss-agg token-mean --num-minibatches 4 (several optimizer steps per batch, so the ratio
    leaves 1)"""
    no_mask: bool = False
    """train continuations on prefix tokens too (unmasked)"""


def validate(args):
    """The ablation flags' checks (cli.parse, after srpo.validate): one line naming the flag, exit code 2."""
    need = {"1x4": 2, "2x4": 4, "1x8": 2}[args.split]  # each group holds >= 2
    g, bad = args.num_generations, f"--num-generations must be a multiple of {need} (at least {need})"
    cli.need(g >= need and g % need == 0, f"{bad} for --split {args.split}, got {g}")
    return args


def split_sizes(args) -> tuple[int, int, int]:
    """(parents, K continuations per parent, base chains) per prompt: --split of the budget G (--num-generations)."""
    n_parents = 2 if args.split == "2x4" else 1
    K = args.num_generations if args.split == "1x8" else args.num_generations // 2
    return n_parents, K, args.num_generations - n_parents * K


def fallback(search, args) -> list:
    """A prompt's official fallback group when no parent was found (before the spare fresh chains top it up): 1x4 its
    base chains, 2x4 the failures found, 1x8 the chains sampled so far. search: srpo.Search."""
    if args.split == "1x8":
        return search.seen[: args.num_generations]
    return search.base[: split_sizes(args)[2]] if args.split == "1x4" else search.parents


def trained(args, mask: torch.Tensor, suffix: torch.Tensor) -> torch.Tensor:
    """The tokens that train [N, T]: --no-mask the continuations' prefixes too (`mask`), else srpo's `suffix`."""
    return mask if args.no_mask else suffix


def surrogate(args, reinforce: torch.Tensor, ratio: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """--clip: PPO's clipped surrogate of the ratio with verl's dual clip (loss <= -3A where A < 0) in place of
    REINFORCE's log p * A (`reinforce`, returned as it is without --clip). ratio, A: [b, T]."""
    if not args.clip:
        return reinforce
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)
    s = torch.min(ratio * A, clipped * A)
    return torch.where(A < 0, torch.max(s, DUAL_CLIP * A), s)
