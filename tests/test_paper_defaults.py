"""Every paper default of the four methods pinned to its source, through the scripts' Args (the command line) and the
defaults of their public functions (what a reader copies). Changing any one of them alone fails this file, which
names each script (grpo.py, sc_grpo.py, grpo_lambda.py, ep_grpo.py, srpo.py). Where a value is this project's
choice rather than the paper's, the comment says so; docs/<method>.md has the table
flag | paper | official code | ours | why."""

import dataclasses
import importlib
import inspect
import sys

import pytest

import ep_grpo
import grpo
import grpo_lambda
import sc_grpo
import srpo
from rlvr_utils.core import cli

ABLATIONS = {sc_grpo: "sc_ablations", ep_grpo: "ep_ablations", srpo: "srpo_ablations", grpo_lambda: "lambda_ablations"}


def defaults(module) -> dict:
    """The script's flags' defaults, its ablation flags' too (rlvr_utils/methods/<method>_ablations.py: the method's
    values)."""
    fields = dataclasses.fields(module.Args)
    if module in ABLATIONS:
        fields += dataclasses.fields(importlib.import_module(f"rlvr_utils.methods.{ABLATIONS[module]}").Ablations)
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in fields}


def parsed_defaults(module, monkeypatch):
    """The Args a run of the script without flags gets (cli.parse: every check, --epsilon-high = --epsilon)."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py"])
    return cli.parse(module.Args, module.validate, ABLATIONS[module])


def signature_defaults(fn) -> dict:
    return {
        k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty
    }


def test_grpo_baseline_defaults():
    """GRPO (Shao et al. 2024, DeepSeekMath §4.1): G completions per prompt, group-normalized advantage, per-sequence
    token mean (seq-mean-token-mean); no KL by default here (DAPO / Dr. GRPO practice), one on-policy step."""
    d = defaults(grpo)
    assert (d["num_generations"], d["prompts_per_step"], d["loss_agg"], d["beta"], d["scale_rewards"]) == (
        8,
        8,
        "seq-mean-token-mean",
        0.0,
        "group",
    )
    assert (d["num_iterations"], d["num_minibatches"], d["epsilon"], d["temperature"], d["top_p"]) == (
        1,
        1,
        0.2,
        1.0,
        1.0,
    )


def test_sc_grpo_paper_defaults(monkeypatch):
    """SC-GRPO (arXiv 2606.18810): f = D/(D + c), c = max(P75 of D, c_min = 1e-4) (§5.1 and ablation A2); alpha 0.1 for
    the solve-none diversity advantage (ablation A3); weighted groups: partial-solve and solve-none (§5); a
    multiplicative weight, not an additive KL loss (Table 2); G 8, 8 prompts per update (§6); seq-mean-token-mean; no
    reference KL."""
    d = defaults(sc_grpo)
    assert (d["percentile"], d["c_min"], d["alpha"]) == (75.0, 1e-4, 0.1)
    assert tuple(d["weighted_groups"]) == ("partial", "none") and d["weight_mode"] == "multiply"
    assert d["kl_loss_coef"] == 0.0
    assert (d["num_generations"], d["prompts_per_step"], d["loss_agg"], d["beta"]) == (8, 8, "seq-mean-token-mean", 0.0)
    assert signature_defaults(sc_grpo.kl_weights) == {"percentile": 75.0, "c_min": 1e-4}
    assert signature_defaults(sc_grpo.diversity_advantage)["alpha"] == 0.1
    # a copier's SCConfig() (weights_and_advantages' default) is the command line's
    assert sc_grpo.SCConfig() == sc_grpo.SCConfig.of(parsed_defaults(sc_grpo, monkeypatch))
    assert sc_grpo.SCConfig() == sc_grpo.SCConfig(75.0, 1e-4, 0.1, unbiased=False)
    assert signature_defaults(sc_grpo.weights_and_advantages)["cfg"] == sc_grpo.SCConfig()
    # one std convention for A and the solve-none z-score: population + 1e-6 (this project's choice, docs/sc_grpo.md)
    assert d["outcome_std"] == "population" and signature_defaults(sc_grpo.diversity_advantage)["eps"] == 1e-6


def test_grpo_lambda_paper_defaults(monkeypatch):
    """GRPO-lambda (arXiv 2510.00194): lambda 0.99, gamma 1, the "both" weighting (§3.2, Eq. 2) applied as the trace
    (epsilon-trace), negative advantages clamped at -0.1; token-mean (the co-author's verl port)."""
    d = defaults(grpo_lambda)
    assert (d["lam"], d["gamma"], d["trace_style"], d["trace_apply"], d["adv_clamp"]) == (
        0.99,
        1.0,
        "both",
        "trace",
        "-0.1",
    )
    assert d["loss_agg"] == "token-mean" and d["beta"] == 0.0
    # a copier's LambdaConfig() (grpo_lambda_token_loss's default) is the command line's
    assert grpo_lambda.LambdaConfig() == grpo_lambda.LambdaConfig.of(parsed_defaults(grpo_lambda, monkeypatch))
    assert signature_defaults(grpo_lambda.grpo_lambda_token_loss)["cfg"] == grpo_lambda.LambdaConfig()
    assert signature_defaults(grpo_lambda.trace_log_ratio)["style"] == "both"


def test_srpo_paper_defaults():
    """SRPO / RRPO (arXiv 2605.25507 and its official code): the 1x4 split (4 base chains + 4 continuations of one
    reset parent), self-localized reset, at most 12 fresh attempts to find a failed parent, localization at
    temperature 0.3, REINFORCE on the suffix (no KL, no clip, suffix mask on), one gradient step per batch (the
    paper's text; the official code makes four mini-batch steps), at most 20 thoughts per chain."""
    d = defaults(srpo)
    assert (d["split"], d["reset"], d["max_fresh_attempts"], d["localization_temperature"]) == ("1x4", "self", 12, 0.3)
    assert (d["temperature"], d["top_p"]) == (1.0, 1.0)  # rollouts: this project's choice (official 0.7 / 0.95)
    assert (d["beta"], d["clip"], d["no_mask"]) == (0.0, False, False)
    assert (d["num_iterations"], d["num_minibatches"], d["num_generations"]) == (1, 1, 8)
    assert (srpo.MAX_THOUGHTS, srpo.THOUGHT_TOKENS) == (20, 256)  # srpo.py
    # the official aggregation; the learning rate is this project's for the tiny model (it collapses at 1e-4)
    assert (d["loss_agg"], d["learning_rate"]) == ("seq-mean-token-mean", 3e-5)


def test_ep_grpo_defaults():
    """EP-GRPO (arXiv 2605.04960), as far as the authors' formulas are known (second-hand): K = 10 cumulative-entropy
    buckets, the implicit signal z-scored per token within a bucket, outcome polarity sign(A) / sign(r - theta) with
    theta = --success-threshold 1.0 (no value is given; any theta in (0, 1] is the same for 0/1 rewards); population
    std for A_out (ours). This project's choices (no source): the soft mass-preserving gate at the
    0.8 quantile, lambda 0.2 (a public ERPO reimplementation's eta), clip 3, k3 KL 1e-3, token-mean."""
    d = defaults(ep_grpo)
    assert (d["num_buckets"], d["progress"], d["process_granularity"]) == (10, "entropy", "token")
    assert (d["process_polarity"], d["success_threshold"], d["outcome_std"]) == ("outcome", 1.0, "population")
    assert (d["gate"], d["pivot_quantile"], d["gate_alpha"], d["gate_norm"], d["gate_gamma"]) == (
        "soft",
        0.8,
        1.0,
        "response",
        1.0,
    )
    assert (d["process_coef"], d["process_coef_zero_var"], d["process_clip"], d["process_anchor"]) == (
        0.2,
        None,
        3.0,
        "ref",
    )
    assert (d["beta"], d["loss_agg"], d["anchor_form"], d["advantage_form"]) == (1e-3, "token-mean", "additive", "A")


@pytest.mark.parametrize("module,fn", [(ep_grpo, ep_grpo.ep_advantages)])
def test_function_defaults_match_the_command_line(module, fn, monkeypatch):
    """A reader who copies the function gets the script's defaults: its own, and its config's (EPConfig())."""
    d = defaults(module)
    sig = signature_defaults(fn)
    assert {k: v for k, v in sig.items() if k in d and v != d[k]} == {}
    assert sig["cfg"] == ep_grpo.EPConfig() == ep_grpo.EPConfig.of(parsed_defaults(module, monkeypatch))
