"""ep_grpo.py: the advantage function's invariants on hand-made batches, and the script end to end."""

import dataclasses
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, run_inprocess, run_script

import common
import ep_grpo
from ep_grpo import cell_zscore, entropy_gate, ep_advantages, progress_windows, row_quantile
from rlvr_utils.core import cli, runtime, tasks
from rlvr_utils.methods import ep_ablations
from rlvr_utils.methods.ep_diagnostics import ep_metrics

ROOT = Path(__file__).resolve().parent.parent

FAST = ["--num-eval", "16", "--eval-every", "0", "--prompts-per-step", "4", "--num-generations", "4"]
G = 4
IDS = [7, 3, 5]  # prompt ids, interleaved below: groups are keyed by id, never by position


def make_batch(seed=0, T=12, equal_rewards=False, same_policy=False):
    """3 groups of G rows, interleaved; lengths 8..T; entropy in [0.9, 1.1] nats (no token spans a window at K <= 4)."""
    g = torch.Generator().manual_seed(seed)
    B = len(IDS) * G
    group_ids = torch.tensor([IDS[i % len(IDS)] for i in range(B)])
    mask = (torch.arange(T) < torch.randint(8, T + 1, (B,), generator=g)[:, None]).long()
    entropy = 0.9 + 0.2 * torch.rand(B, T, generator=g)
    logp_old = -torch.rand(B, T, generator=g) * 3
    logp_ref = logp_old.clone() if same_policy else logp_old - 0.5 * torch.randn(B, T, generator=g)
    if equal_rewards:
        rewards = torch.ones(B)
    else:  # groups 7 and 3 mixed, group 5 all wrong
        rewards = torch.tensor([float(i % 2 == 0 and i % 3 != 2) for i in range(B)])
        rewards[1] = 1.0
    return dict(entropy=entropy, logp_old=logp_old, logp_ref=logp_ref, mask=mask, rewards=rewards, group_ids=group_ids)


ABLATED = runtime.ablated(ep_grpo.Args, "ep_ablations", "gate")  # Args with the ablation flags, as cli.parse makes it
ABLATION_FLAGS = {f.name for f in dataclasses.fields(ep_ablations.Ablations)}


def ep(*batch, return_parts=False, scores=None, **flags):
    """The token advantages of `batch` (ep_advantages' positional arguments) with `flags` (Args fields, the
    ablations' too) over the defaults: ep_advantages, or with an ablation flag ep_ablations.wrap's, as ep_grpo.py
    calls them."""
    args = ABLATED(**flags)
    fn = ep_ablations.wrap(args, vars(ep_grpo)) if set(flags) & ABLATION_FLAGS else ep_advantages
    return fn(*batch, cfg=ep_grpo.EPConfig.of(args), scores=scores, return_parts=return_parts)


def adv(b, return_parts=False, scores=None, **flags):
    """`ep` on a batch dict."""
    x = (b["entropy"], b["logp_old"], b["logp_ref"], b["mask"], b["rewards"], G, b["group_ids"])
    return ep(*x, return_parts=return_parts, scores=scores, **flags)


def clipped_loss(token_adv, logp, old, ref, mask, loss_agg, beta=1e-3, eps=0.2, eps_high=0.28):
    """grpo.py's loss, line for line (ratio, clipped surrogate, k3 KL, common.aggregate_loss)."""
    m = mask.float()
    ratio = torch.exp(logp - old)
    surrogate = torch.min(ratio * token_adv, torch.clamp(ratio, 1 - eps, 1 + eps_high) * token_adv)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token_loss = -surrogate + beta * kl
    return common.aggregate_loss(per_token_loss, m, loss_agg, mask.shape[1], m.sum().item(), mask.shape[0])


@pytest.mark.parametrize("loss_agg", common.LOSS_AGG_MODES)
@pytest.mark.parametrize("scale", ["group", "none"])
def test_alpha_lambda_zero_is_exactly_grpo_loss(loss_agg, scale):
    b = make_batch()
    T = b["mask"].shape[1]
    logp = b["logp_old"] + 0.3 * torch.randn(b["mask"].shape, generator=torch.Generator().manual_seed(1))
    logp.requires_grad_(True)

    def loss_and_grad(token_adv):
        logp.grad = None
        loss = clipped_loss(token_adv, logp, b["logp_old"], b["logp_ref"], b["mask"], loss_agg)
        loss.backward()
        return loss.detach(), logp.grad.clone()

    grpo_adv = common.group_advantages(b["rewards"], G, scale, group_ids=b["group_ids"])  # as grpo.py does
    grpo_loss, grpo_grad = loss_and_grad(grpo_adv[:, None].expand(-1, T))
    assert grpo_adv.abs().sum() > 0
    ep_loss, ep_grad = loss_and_grad(
        adv(b, gate_alpha=0.0, process_coef=0.0, scale_rewards=scale, outcome_std="unbiased")
    )
    assert torch.equal(ep_loss, grpo_loss) and torch.equal(ep_grad, grpo_grad)
    # each term alone changes the loss (so the equality above is not a tautology)
    for kw in ({}, {"gate_alpha": 0.0}, {"process_coef": 0.0}):
        assert not torch.equal(
            loss_and_grad(adv(b, scale_rewards=scale, outcome_std="unbiased", **kw))[1], grpo_grad
        ), kw


@pytest.mark.parametrize("gate", ["soft", "hard", "gtpo"])
def test_gate_has_mean_one_per_response_and_favours_pivots(gate):
    b = make_batch()
    H = torch.rand(b["mask"].shape, generator=torch.Generator().manual_seed(2)) * 3
    tau = torch.quantile(H[b["mask"].bool()], 0.8)
    weights = ep_ablations.gate_weights(H, tau, 0.1, gate) if gate != "soft" else None  # the other gates: ablations
    g = entropy_gate(H, b["mask"], tau) if gate == "soft" else ep_grpo.mean_one(weights, b["mask"])
    m = b["mask"].float()
    assert torch.allclose((g * m).sum(1) / m.sum(1), torch.ones(len(m)), atol=1e-5)
    assert (g * (1 - m)).abs().sum() == 0
    pivots, others = (H > tau) & m.bool(), (H <= tau) & m.bool()
    assert g[pivots].min() > 1.0 and g[others].mean() < 1.0
    # the same gate comes out of ep_advantages
    _, parts = adv(dict(b, entropy=H), gate=gate, return_parts=True)
    assert torch.allclose((parts["gate"] * m).sum(1) / m.sum(1), torch.ones(len(m)), atol=1e-5)


def test_soft_gate_spec_example():
    """20% pivots, alpha = 1: pivots get 2/1.2 ~ 1.67, the others 1/1.2 ~ 0.83 (docs/ep_grpo.md, the gate)."""
    H = torch.tensor([[5.0, 5.0] + [0.0] * 8])
    g = entropy_gate(H, torch.ones_like(H), torch.tensor(2.5))
    assert torch.allclose(g, torch.tensor([[2 / 1.2] * 2 + [1 / 1.2] * 8]), atol=1e-5)
    assert torch.allclose(entropy_gate(H, torch.ones_like(H), 2.5, norm="none"), torch.tensor([[2.0] * 2 + [1.0] * 8]))


def test_equal_rewards_train_only_when_the_policy_has_moved():
    moved = make_batch(equal_rewards=True)
    a, parts = adv(moved, num_buckets=4, return_parts=True)
    valid = moved["mask"].bool()
    assert (a[valid] != 0).all() and (a[~valid] == 0).all()
    assert torch.isfinite(a).all()
    assert ep_metrics(a, parts, moved["entropy"], moved["mask"])["ep/zero_var_groups_with_grad"] == 1.0
    same = make_batch(equal_rewards=True, same_policy=True)
    a0, parts0 = adv(same, num_buckets=4, return_parts=True)
    assert (a0 == 0).all()
    metrics = ep_metrics(a0, parts0, same["entropy"], same["mask"])
    assert metrics["ep/zero_var_groups_with_grad"] == 0.0 and metrics["ep/frac_flat_windows"] == 1.0
    # a drift below sigma_min is no signal: exactly 0, not a blown-up z-score of rounding noise
    tiny = dict(same, logp_ref=same["logp_old"] - 1e-6 * torch.randn(same["mask"].shape))
    assert (adv(tiny, num_buckets=4) == 0).all()
    # lambda_0 = 0 turns the process signal off in all-equal groups only
    assert (adv(moved, process_coef_zero_var=0.0) == 0).all()
    mixed = make_batch()
    zero_var = torch.tensor([i % 3 == 2 for i in range(len(IDS) * G)])
    a_mixed, a_mixed0 = adv(mixed), adv(mixed, process_coef_zero_var=0.0)
    assert torch.equal(a_mixed[~zero_var], a_mixed0[~zero_var])
    assert (a_mixed[zero_var] != 0).any() and (a_mixed0[zero_var] == 0).all()


@pytest.mark.parametrize(
    "entropy,mask,K,windows",
    [
        ([1, 1, 1, 1], [1, 1, 1, 1], 4, [0, 1, 2, 3]),  # equal entropy: equal windows
        ([3, 0.5, 0.5], [1, 1, 1], 2, [0, 1, 1]),  # u = 1.5/4, 3.25/4, 3.75/4
        ([0, 4, 0], [1, 1, 1], 4, [0, 2, 3]),  # one token holds all the entropy: window 1 is skipped
        ([1, 1, 9, 9], [1, 1, 0, 0], 2, [0, 1, 0, 0]),  # padded tokens are ignored (and get window 0)
        ([0, 0, 0, 0], [1, 1, 1, 1], 2, [0, 0, 1, 1]),  # zero entropy: positional (t - 1/2)/T
        ([0.1, 0.1, 0.1, 5.0, 0.1], [1, 1, 1, 1, 1], 10, [0, 0, 0, 5, 9]),  # a pivot spans most of the progress
    ],
)
def test_progress_windows_hand_cases(entropy, mask, K, windows):
    b, zero = progress_windows(torch.tensor([entropy], dtype=torch.float), torch.tensor([mask]), K)
    assert b.tolist() == [windows]
    assert zero.tolist() == [sum(entropy) == 0]


def test_position_progress_ignores_entropy():
    b, _ = progress_windows(torch.tensor([[0.0, 4.0, 0.0, 0.0]]), torch.ones(1, 4), 4, progress="position")
    assert b.tolist() == [[0, 1, 2, 3]]


def test_process_signal_is_a_window_z_score_and_can_flip_polarity():
    """G = 2, two windows of two tokens: window 0's delta sums are -1 / +1 (z = -1 / +1), window 1 is flat."""
    entropy, mask = torch.ones(2, 4), torch.ones(2, 4)
    logp_ref = torch.zeros(2, 4)
    logp_old = torch.tensor([[-1.0, 0, 0, 0], [1.0, 0, 0, 0]])
    rewards = torch.tensor([1.0, 0.0])  # A_out = +-1 (population std 1/2)

    def run(lam):
        return ep(
            entropy,
            logp_old,
            logp_ref,
            mask,
            rewards,
            2,
            num_buckets=2,
            process_coef=lam,
            gate_alpha=0.0,
            process_granularity="window",
            process_polarity="none",
            return_parts=True,
        )

    a, parts = run(1.5)
    assert parts["windows"].tolist() == [[0, 0, 1, 1]] * 2
    assert parts["process"].tolist() == [[-1.0, -1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    assert torch.allclose(a, torch.tensor([[-0.5, -0.5, 1, 1], [0.5, 0.5, -1, -1]]), atol=1e-5)
    assert ep_metrics(a, parts, entropy, mask)["ep/polarity_flip_rate"] == 0.5
    a_small, parts_small = run(0.5)  # |lambda P| < |A_out|: no flips
    assert ep_metrics(a_small, parts_small, entropy, mask)["ep/polarity_flip_rate"] == 0.0
    m = ep_metrics(a, parts, entropy, mask)
    assert m["ep/frac_flat_windows"] == 0.5 and m["ep/process_abs_mixed"] == 0.5


def test_bad_input_no_nan_and_counted():
    """Identical responses, a zero-entropy response and a window with one member, in one batch."""
    T = 4
    entropy = torch.tensor([[1.0, 1, 1, 1]] * 2 + [[0.0, 0, 0, 0], [1.0, 1, 1, 1]] + [[0.0, 4, 0, 0], [1.0, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1]] * 4 + [[1, 1, 1, 0], [1, 1, 1, 1]])
    logp_old = torch.tensor([[-1.0, -2, -3, -4]] * 2 + [[-0.5] * T, [-1.0] * T] + [[-2.0] * T, [-1.0] * T])
    logp_ref = logp_old - torch.tensor([[0.5] * T] * 2 + [[0.1] * T, [0.9] * T] + [[0.3] * T, [0.2] * T])
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    a, parts = ep(entropy, logp_old, logp_ref, mask, rewards, 2, num_buckets=4, return_parts=True)
    m = ep_metrics(a, parts, entropy, mask)
    assert torch.isfinite(a).all() and all(math.isfinite(v) for v in m.values())
    assert (a[:2] == 0).all()  # identical responses in an all-equal group: nothing to learn
    assert (a[2:4] != 0).all()  # the zero-entropy response still gets process credit (positional windows)
    assert parts["zero_entropy"].tolist() == [False, False, True, False, False, False]
    assert parts["windows"][4].tolist() == [0, 2, 3, 0]  # window 1 only has the other response's token
    assert a[5, 1] == 0 and (a[5, [0, 2, 3]] != 0).all()  # a window with one member gets no process signal
    assert m["ep/frac_zero_entropy_responses"] == pytest.approx(1 / 6)
    assert m["ep/frac_singleton_windows"] == pytest.approx(1 / 12)  # 12 occupied (group, window) cells
    assert m["ep/frac_flat_windows"] == pytest.approx(4 / 12)  # the identical pair's 4 windows
    assert m["ep/frac_zero_var_groups"] == 1.0 and m["ep/zero_var_groups_with_grad"] == pytest.approx(2 / 3)
    # a batch with no entropy at all: the threshold is 0, every gate form stays finite
    for gate in ("soft", "hard", "gtpo", "none"):
        out = ep(torch.zeros(6, T), logp_old, logp_ref, mask, rewards, 2, gate=gate)
        assert torch.isfinite(out).all(), gate
    # sigma_min = 0: flat windows and one-member windows must still not divide by zero
    assert torch.equal(
        ep(entropy, logp_old, logp_ref, mask, rewards, 2, num_buckets=4, process_std_min=0.0),
        a,
    )


@pytest.mark.parametrize("entropy,share", [([10.0] + [0.0] * 9, 1.0), ([1.0] * 10, 0.2), ([5.0] * 5 + [0.0] * 5, 0.4)])
def test_entropy_top20_share(entropy, share):
    H, mask = torch.tensor([entropy, [99.0] * 10]), torch.tensor([[1] * 10, [0] * 10])  # the padded row is ignored
    a, parts = ep_advantages(H, torch.zeros(2, 10), torch.zeros(2, 10), mask, torch.zeros(2), 2, return_parts=True)
    m = ep_metrics(a, parts, H, mask)
    assert m["ep/entropy_top20_share"] == pytest.approx(share)
    assert m["ep/pivot_frac"] == pytest.approx((torch.tensor(entropy) > parts["pivot"][0]).float().sum().item() / 10)


VARIANTS = [
    {"gate": "hard"},
    {"gate": "gtpo"},
    {"gate": "none"},
    {"gate_norm": "none"},
    {"pivot_scope": "group"},
    {"pivot_scope": "response"},
    {"process_granularity": "window"},
    {"process_granularity": "cumulative"},
    {"process_polarity": "none"},
    {"success_threshold": -0.5},
    {"gate": "zsig"},
    {"gate": "zsig", "gate_gamma": 3.0},
    {"anchor_form": "multiplicative"},
    {"progress": "position"},
    {"advantage_form": "B"},
    {"scale_rewards": "none"},
    {"num_buckets": 1},
    {"process_clip": 0.5},
]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_every_flag_gives_finite_masked_advantages_that_differ_from_the_default(kw):
    b = make_batch(seed=3)
    a, parts = adv(b, return_parts=True, **kw)
    clip = kw.get("process_clip", 3.0)
    assert torch.isfinite(a).all() and (a[b["mask"] == 0] == 0).all()
    assert parts["process"].abs().max() <= clip + 1e-6
    assert not torch.allclose(a, adv(b)), "the flag had no effect"
    if kw.get("anchor_form") == "multiplicative":  # sign-anchored: no flips, nothing in all-equal groups
        assert ep_metrics(a, parts, b["entropy"], b["mask"])["ep/polarity_flip_rate"] == 0.0
        assert (a[parts["zero_var"]] == 0).all()


@pytest.mark.parametrize(
    "flag",
    [["--gate", "sigmoid"], ["--outcome-std", "unbaised"], ["--num-buckets", "0"], ["--pivot-quantile", "1.5"]],
)
def test_unknown_choice_is_a_clear_error_at_parse_time(flag):
    """The flags are checked once, when parsed (tyro's choices, validate's ranges): one line naming the flag, exit 2
    (ep_advantages itself no longer checks them)."""
    r = subprocess.run([sys.executable, "ep_grpo.py", *flag], cwd=ROOT, capture_output=True, text=True, timeout=120)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error:") and flag[0] in err[0], r.stderr


def test_window_z_scores_have_zero_mean_in_each_group_window():
    b = make_batch(seed=4)
    S = torch.randn(len(IDS) * G, 5)
    present = torch.rand(S.shape) > 0.2
    _, inv = torch.unique(b["group_ids"], return_inverse=True)
    cells = inv[:, None] * 5 + torch.arange(5)
    z, n, ok = cell_zscore(S, present, cells, 15, clip=10.0)
    sums = torch.zeros(15).index_add(0, cells.reshape(-1), z.reshape(-1))
    assert torch.allclose(sums, torch.zeros(15), atol=1e-5)
    assert ((z != 0) == (ok[cells] & present)).all()


def test_every_method_flag_reaches_ep_advantages():
    """ep_advantages reads a small record (EPConfig), by name: every name it reads is a field of it, every field is
    read, and the fields are the method's own flags (Args, but the loss's beta and loss_agg) and the two shared ones it
    needs, so a flag cannot silently keep a default; the ablations' flags are not among them
    (rlvr_utils/methods/ep_ablations.py)."""
    import ast
    import inspect

    fields = [f.name for f in dataclasses.fields(ep_grpo.EPConfig)]
    tree = ast.parse(inspect.getsource(ep_advantages))
    read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "f"}
    assert read == set(fields)
    own = {f.name for f in dataclasses.fields(ep_grpo.Args)} - {f.name for f in dataclasses.fields(cli.BaseArgs)}
    assert set(fields) == own - {"beta", "loss_agg"} | {"scale_rewards", "success_threshold"}
    assert not set(fields) & ABLATION_FLAGS and len(fields) <= 15
    assert len(inspect.signature(ep_advantages).parameters) <= 10


def test_row_quantile_matches_torch_quantile():
    x = torch.randn(4, 50)
    valid = torch.rand(4, 50) > 0.3
    valid[3] = False
    q = row_quantile(x, valid, 0.8)
    for i in range(3):
        assert torch.allclose(q[i], torch.quantile(x[i][valid[i]], 0.8))
    assert q[3] == 0


@pytest.mark.slow
def test_ep_grpo_two_steps_subprocess(tmp_path):
    out = run_script("ep_grpo.py", "--total-steps", "2", "--output-dir", str(tmp_path), *FAST)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "reward",
        "policy_loss",
        "kl",
        "entropy",
        "time/advantages",
        "ep/frac_zero_var_groups",
        "ep/zero_var_groups_with_grad",
        "ep/entropy_top20_share",
        "ep/polarity_flip_rate",
        "ep/process_abs_mixed",
        "ep/process_abs_zero_var",
        "ep/frac_zero_entropy_responses",
        "ep/frac_singleton_windows",
        "ep/frac_flat_windows",
    ):
        assert key in rows[1], key
    assert all(v == v for r in rows for v in r.values())  # no NaN


def _alternating_reward_task(monkeypatch):
    """Rewards 1, 0, 1, 0, ... in call order: every group of 4 is mixed, whatever the model has learned."""
    real, calls = tasks.load_task, itertools.count()

    def task(*a, **k):
        t = real(*a, **k)
        t.reward_fn = lambda completion, ex: float(next(calls) % 2 == 0)
        return t

    monkeypatch.setattr(tasks, "load_task", task)


@pytest.mark.slow
def test_cli_alpha_lambda_zero_reproduces_grpo_py(tmp_path, monkeypatch):
    _alternating_reward_task(monkeypatch)
    flags = ["--total-steps", "2", "--temperature", "1.5", *FAST]  # hot sampling: groups differ even on a sharp model
    run_inprocess("grpo.py", "--output-dir", str(tmp_path / "g"), "--beta", "0.001", "--loss-agg", "token-mean", *flags)
    run_inprocess(
        "ep_grpo.py",
        "--output-dir",
        str(tmp_path / "e"),
        "--gate-alpha",
        "0",
        "--process-coef",
        "0",
        "--outcome-std",
        "unbiased",
        *flags,
    )
    grpo, ep = read_metrics(tmp_path / "g"), read_metrics(tmp_path / "e")
    assert any(r["grad_norm"] > 0 for r in grpo[1:])
    for key in ("reward", "policy_loss", "grad_norm", "kl", "entropy"):
        assert [r[key] for r in grpo[1:]] == [r[key] for r in ep[1:]], key


@pytest.mark.slow
@pytest.mark.parametrize(
    "anchor,flags,moved",
    [("lagged", ["--anchor-lag", "2"], [False, True, False]), ("ema", ["--anchor-ema-decay", "0"], [False, False])],
)
def test_moving_anchor(tmp_path, monkeypatch, anchor, flags, moved):
    """The anchor starts as the policy (no process signal at step 1). Lagged resets it to the policy every 2 steps
    (signal at step 2 only); an ema with decay 0 is the policy itself after every step (never a signal).
    sigma_min = 0 makes any drift count; an anchor equal to the policy gives delta = 0 exactly."""
    _alternating_reward_task(monkeypatch)
    run_inprocess(
        "ep_grpo.py",
        "--output-dir",
        str(tmp_path),
        "--total-steps",
        str(len(moved)),
        *FAST,
        "--beta",
        "0",
        "--temperature",
        "1.5",
        "--process-std-min",
        "0",
        "--process-anchor",
        anchor,
        *flags,
        "--pivot-scope",
        "group",
    )
    rows = read_metrics(tmp_path)[1:]
    assert all(r["grad_norm"] > 0 for r in rows) and all(v == v for r in rows for v in r.values())
    assert all("kl" not in r for r in rows)  # beta 0 with a moving anchor: the reference forward is skipped
    assert [r["ep/process_abs_mixed"] + r["ep/process_abs_zero_var"] > 0 for r in rows] == moved


def test_outcome_advantage_uses_the_population_std_by_default():
    """docs/ep_grpo.md: A_out = (r - mean) / (std_pop + 1e-6); at G = 8 the unbiased std (grpo.py) would scale A_out by
    sqrt(7/8) = 0.935 against the process term. Hand value: rewards 1,1,0,0,0,0,0,0 -> mean 1/4, std_pop sqrt(3)/4."""
    r = torch.tensor([1.0, 1, 0, 0, 0, 0, 0, 0])
    mask = torch.ones(8, 3)
    zero = torch.zeros(8, 3)
    a = ep(zero + 1.0, zero, zero, mask, r, 8, gate="none", process_coef=0.0)
    want = torch.tensor([0.75, 0.75] + [-0.25] * 6) / (3**0.5 / 4 + 1e-6)
    assert torch.allclose(a, want[:, None].expand(-1, 3), atol=1e-6)
    u = ep(zero + 1.0, zero, zero, mask, r, 8, gate="none", process_coef=0.0, outcome_std="unbiased")
    assert torch.allclose(u / a, torch.full_like(a, (7 / 8) ** 0.5), atol=1e-3)


def test_zsig_gate_is_the_authors_sigmoid_of_the_group_z_score():
    """W = sigmoid(gamma * (H - mean_G H) / std_G H), population std, no mass preservation: entropies (0, 1, 2, 3)
    in one group give W = (0.2072, 0.3900, 0.6100, 0.7928) at gamma = 1 (hand values: z = (+-1.342, +-0.447))."""
    H = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    one = torch.ones(4, 1)
    _, parts = ep(
        H,
        one * 0,
        one * 0,
        one,
        torch.tensor([1.0, 0, 0, 0]),
        4,
        gate="zsig",
        gate_norm="none",
        pivot_scope="group",
        return_parts=True,
    )
    assert torch.allclose(parts["gate"].squeeze(1), torch.tensor([0.2072, 0.3900, 0.6100, 0.7928]), atol=1e-4)
    steep = ep(
        H,
        one * 0,
        one * 0,
        one,
        torch.tensor([1.0, 0, 0, 0]),
        4,
        gate="zsig",
        gate_norm="none",
        pivot_scope="group",
        gate_gamma=5.0,
        return_parts=True,
    )[1]["gate"].squeeze(1)
    assert steep[0] < 0.01 and steep[3] > 0.99  # gamma sharpens the gate


def test_outcome_polarity_signs_the_process_credit():
    """d = sign(A_out) in mixed groups, sign(r - 0.5) in all-equal ones: an all-wrong group's process credit is
    anti-correlated with the drift delta (pulled back to the reference), an all-correct group's correlated."""
    g = torch.Generator().manual_seed(5)
    T, B = 6, 12
    entropy, mask = torch.ones(B, T), torch.ones(B, T)
    logp_ref = -torch.rand(B, T, generator=g)
    logp_old = logp_ref + torch.randn(B, T, generator=g)  # delta = logp_old - logp_ref
    rewards = torch.tensor([0.0] * 4 + [1.0] * 4 + [1.0, 0, 0, 0])  # all-wrong, all-correct, mixed
    a, parts = ep(entropy, logp_old, logp_ref, mask, rewards, 4, gate="none", return_parts=True)
    assert parts["polarity"].tolist() == [-1.0] * 4 + [1.0] * 4 + [1.0, -1, -1, -1]
    delta = logp_old - logp_ref

    def corr(x, y):
        x, y = x - x.mean(), y - y.mean()
        return (x * y).sum() / (x.norm() * y.norm())

    assert corr(a[:4].flatten(), delta[:4].flatten()) < -0.5
    assert corr(a[4:8].flatten(), delta[4:8].flatten()) > 0.5
    unsigned = ep(entropy, logp_old, logp_ref, mask, rewards, 4, gate="none", process_polarity="none")
    assert torch.equal(a[:4], -unsigned[:4]) and torch.equal(a[4:8], unsigned[4:8])  # d = -1 / +1
    lam_p = unsigned[8:] - parts["outcome"][8:, None]  # mixed group: A = A_out + lambda * d * P
    assert torch.allclose(a[8:], parts["outcome"][8:, None] + parts["polarity"][8:, None] * lam_p, atol=1e-6)
    assert corr(unsigned[:4].flatten(), delta[:4].flatten()) > 0.5  # the old rule rewarded the drift of failures
    # all-equal groups: zero-sum over each (group, window) cell and bounded by lambda_0 * clip (gate "none")
    cells = parts["group_index"][:, None] * 10 + parts["windows"]
    sums = torch.zeros(40).index_add(0, cells[:8].reshape(-1), a[:8].reshape(-1))
    assert torch.allclose(sums, torch.zeros(40), atol=1e-5)
    assert a[:8].abs().max() <= 0.2 * 3.0 + 1e-6
    m = ep_metrics(a, parts, entropy, mask)
    assert m["ep/frac_zero_var_all_correct"] == pytest.approx(1 / 3)
    assert m["ep/delta_mean"] == pytest.approx(delta.mean().item(), abs=1e-6)
    share = a[:8].abs().sum() / a.abs().sum()
    assert m["ep/zero_var_adv_share"] == pytest.approx(share.item(), rel=1e-5) and 0 < share < 1


def _tabular_drift(polarity, reward, steps=40, seed=0, lr=0.5):
    """A policy of independent per-position softmaxes [T, V], started away from its reference, trained on-policy with
    EP-GRPO's advantage on groups whose rewards are all `reward`. Returns the exact KL(pi || pi_ref) before and
    after."""
    g = torch.Generator().manual_seed(seed)
    T, V, G, n = 8, 6, 8, 4
    ref = torch.randn(T, V, generator=g)
    theta = (ref + 0.5 * torch.randn(T, V, generator=g)).requires_grad_(True)

    def kl():
        lp, lq = theta.log_softmax(-1), ref.log_softmax(-1)
        return (lp.exp() * (lp - lq)).sum().item()

    before = kl()
    for _ in range(steps):
        with torch.no_grad():
            probs = theta.softmax(-1).repeat(G * n, 1, 1).reshape(-1, V)
            tok = torch.multinomial(probs, 1, generator=g).reshape(G * n, T)
        lp = theta.log_softmax(-1)
        logp = lp.gather(1, tok.T).T  # [B, T]
        entropy = -(lp.exp() * lp).sum(-1).detach().expand(G * n, T)
        logp_ref = ref.log_softmax(-1).gather(1, tok.T).T
        mask = torch.ones(G * n, T)
        A = ep(entropy, logp.detach(), logp_ref, mask, torch.full((G * n,), reward), G, process_polarity=polarity)
        theta.grad = None
        (-(A * logp).sum() / mask.sum()).backward()
        with torch.no_grad():
            theta -= lr * theta.grad
    return before, kl()


@pytest.mark.parametrize("seed", [0, 1])
def test_all_wrong_groups_do_not_feed_drift(seed):
    """The collapse of the first reconstruction: with rewards all 0, unsigned process credit is gradient ascent on
    KL(pi || pi_ref) (the policy is paid for moving away from where it was), so repeated updates keep raising it.
    With the default outcome polarity an all-wrong group pulls back towards the reference instead."""
    before, after = _tabular_drift("outcome", 0.0, seed=seed)
    assert after < 0.8 * before
    before_none, after_none = _tabular_drift("none", 0.0, seed=seed)
    assert after_none > 1.2 * before_none


def test_moving_anchors_are_refused_under_fsdp_before_anything_loads():
    """--process-anchor ema/lagged deep-copies the policy after it is sharded, and its checkpoint is rank 0's copy:
    under torchrun with --fsdp it is refused with one line (the variables torchrun sets; nothing connects)."""
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for anchor in ("ema", "lagged"):
        r = subprocess.run(
            [sys.executable, "ep_grpo.py", "--fsdp", "--process-anchor", anchor],
            cwd=ROOT, capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert r.returncode == 2 and "--process-anchor ema/lagged do not support --fsdp" in r.stderr, r.stderr[-2000:]


def test_an_unscored_rollout_is_left_out_of_its_groups_process_statistics():
    """Rewards [1, None, 0], one window: delta's z-score is over the scored rows' tokens (mean 0, std 1: P = +1 / -1),
    not pulled by the unscored row's large delta; the unscored row gets P = 0 and A = 0. With gate_alpha 0 and
    lambda 0.2: A = A_out + lambda * d * P = 1 + 0.2 and -1 + 0.2 (A_out = +-1, population std)."""
    entropy, mask = torch.ones(3, 2), torch.ones(3, 2)
    logp_old = torch.tensor([[1.0, 1.0], [100.0, 100.0], [-1.0, -1.0]])
    flags = dict(num_buckets=1, gate_alpha=0.0, process_coef=0.2)
    rewards = torch.tensor([1.0, math.nan, 0.0])
    a, parts = ep(entropy, logp_old, torch.zeros(3, 2), mask, rewards, 3, **flags, return_parts=True)
    assert parts["process"].tolist() == [[1.0, 1.0], [0.0, 0.0], [-1.0, -1.0]]
    assert parts["cell_members"].tolist() == [[4.0]]  # the scored rows' four tokens (one group, one window)
    assert torch.allclose(a, torch.tensor([[1.2, 1.2], [0.0, 0.0], [-0.8, -0.8]]), atol=1e-5)
    for form in (dict(advantage_form="B"), dict(anchor_form="multiplicative"), dict(process_granularity="window")):
        b = ep(entropy, logp_old, torch.zeros(3, 2), mask, rewards, 3, **flags, **form)
        assert torch.isfinite(b).all() and (b[1] == 0).all() and (b[0] != 0).all(), form
