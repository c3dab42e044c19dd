"""Fast tests with hand-computed values for rules that a one-token change to the code would otherwise break unseen:
EP-GRPO's polarity from the verifier's score, SC-GRPO's weighted span and its micro-batches of whole groups, the
engine importance weight that multiplies the policy-gradient term but not the KL term, SRPO's population std."""

import copy
import math

import pytest
import torch
from helpers import read_metrics, run_inprocess

import ep_grpo
import sc_grpo
import srpo
from rlvr_utils.extras.scale import engines
from sc_grpo import Role


def test_ep_grpo_polarity_is_the_verifiers_not_the_shaped_reward():
    """An all-equal group whose rewards an overlong penalty shaped to 0.8 but whose verifier scores are 1 (solved):
    d = +1 (the shaped reward alone, 0.8 < 1, would give -1)."""
    B, T = 4, 3
    H, mask = torch.full((B, T), 0.5), torch.ones(B, T)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -1.0, -0.2], [-0.7, -2.5, -1.0], [-1.2, -0.3, -0.9]])
    ref = torch.full((B, T), -1.0)
    rewards = torch.full((B,), 0.8)
    _, parts = ep_grpo.ep_advantages(H, old, ref, mask, rewards, 4, scores=torch.ones(B), return_parts=True)
    assert parts["polarity"].tolist() == [1.0] * B
    _, unscored = ep_grpo.ep_advantages(H, old, ref, mask, rewards, 4, return_parts=True)  # no scores: rewards decide
    assert unscored["polarity"].tolist() == [-1.0] * B


def test_sc_grpo_weighted_span_is_the_first_wlen_tokens_of_weighted_rows():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    role = torch.tensor([Role.WEIGHTED, Role.DIVERSITY, Role.PLAIN, Role.REFERENCE])
    wlen = torch.tensor([4, 2, 3, 5])  # a solve-none row weighs min(|o_i|, |o_r|) = 2 tokens
    want = [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert sc_grpo.weighted_tokens(mask, role, wlen).tolist() == want


@pytest.mark.parametrize(
    "size, want",
    [(6, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]), (9, [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]]), (3, None)],
)
def test_sc_grpo_micro_batches_hold_whole_groups_when_the_size_is_not_a_multiple_of_g(size, want):
    """G = 4: --micro-batch-size 6 -> one group per micro-batch, 9 -> two, 3 (< G) -> one group anyway; groups keep
    their order of first appearance, interleaved rows included."""
    gid = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3, 5, 5, 5, 5])
    got = sc_grpo.micro_batches_of_groups(torch.arange(12), gid, 4, size)
    assert [m.tolist() for m in got] == (want or [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    mixed = torch.tensor([1, 2, 1, 2, 1, 2, 1, 2])
    got = sc_grpo.micro_batches_of_groups(torch.arange(8), mixed, 4, 6)
    assert [m.tolist() for m in got] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_srpo_advantage_is_the_population_z_score_without_epsilon():
    """Groups {1, 0, 0, 0} and {1, 0}: mean 1/4, population std sqrt(3)/4 -> (sqrt 3, -1/sqrt 3 x3); mean 1/2, std
    1/2 -> (+1, -1); an all-equal group -> 0. (Bessel's std would give 1.5 and -0.5 for the first group.)"""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    a = srpo.srpo_advantages(rewards, gid)
    s3 = math.sqrt(3)
    assert torch.allclose(a, torch.tensor([s3, -1 / s3, -1 / s3, -1 / s3, 1.0, -1.0, 0.0, 0.0]), atol=1e-6)


@pytest.mark.parametrize("script", ["grpo.py", "sc_grpo.py", "grpo_lambda.py", "ep_grpo.py", "srpo.py"])
def test_the_engine_weight_multiplies_the_policy_term_but_not_the_kl(script, tmp_path, monkeypatch):
    """With an engine weight of 0 on every token (vLLM's correction, patched) and a reference that differs from the
    policy, the loss is beta times the KL alone: > 0. Were the weight to multiply the KL term as well, it would be 0."""
    real_copy = copy.deepcopy

    def perturbed_copy(x, *a, **k):  # the reference model: the policy plus noise, so that KL > 0 from step 1
        out = real_copy(x, *a, **k)
        if isinstance(out, torch.nn.Module):
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in out.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
        return out

    monkeypatch.setattr(copy, "deepcopy", perturbed_copy)
    monkeypatch.setattr(engines, "engine_correction", lambda *a, **k: 0.0)
    flags = ["--total-steps", "1", "--eval-every", "0", "--num-eval", "2", "--prompts-per-step", "2"]
    flags += ["--num-generations", "4", "--max-new-tokens", "24", "--beta", "0.5", "--output-dir", str(tmp_path)]
    run_inprocess(script, *flags)
    (row,) = [r for r in read_metrics(tmp_path) if r["step"] == 1]
    # only beta * KL is left, and it is there (equal up to how the loss and the kl metric average over tokens)
    assert row["kl"] > 1e-3 and row["policy_loss"] == pytest.approx(0.5 * row["kl"], rel=0.5), row
