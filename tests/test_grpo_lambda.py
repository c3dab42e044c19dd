"""GRPO-λ (grpo_lambda.py): the O(T) trace against its O(T²) definition, the GRPO limit, the on-policy c_k identity
(docs/grpo_lambda.md; c_k's closed form is rlvr_utils/methods/trace_diagnostics.trace_multipliers), the advantage
clamp, bad input, and a few steps of the script."""

import importlib.util
import json

import pytest
import torch
from conftest import ROOT
from helpers import read_metrics, run_dir, run_inprocess, run_script

import common
from rlvr_utils.core import runtime
from rlvr_utils.methods import lambda_ablations
from rlvr_utils.methods.trace_diagnostics import trace_multipliers

_spec = importlib.util.spec_from_file_location("grpo_lambda", ROOT / "grpo_lambda.py")
gl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gl)

FAST = ["--num-eval", "16", "--eval-every", "0", "--prompts-per-step", "4", "--num-generations", "4"]


def weight_matrix(L, a, style):
    """The definition: W[t, k] = w(t, k) for k <= t, float64, O(L²)."""
    t = torch.arange(L, dtype=torch.float64)[:, None]
    k = torch.arange(L, dtype=torch.float64)[None, :]
    w = a ** (t - k).clamp(min=0)
    if style == "both":
        w = torch.maximum(w, a**k)
    return torch.where(k <= t, w, 0.0)


def right_padded(lengths, T=None):
    T = T or max(lengths)
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()


def grpo_loss(logp, old, A, mask, agg, eps=0.2, eps_high=0.28):
    """grpo.py's step 5, line for line: ratio, clipped surrogate, common.aggregate_loss."""
    ratio = torch.exp(logp - old)
    surrogate = torch.min(ratio * A, torch.clamp(ratio, 1 - eps, 1 + eps_high) * A)
    per_token_loss = -surrogate
    return common.aggregate_loss(per_token_loss, mask.float(), agg, 48, mask.sum().item(), mask.shape[0])


def lambda_loss(logp, old, A, mask, agg, lam, style, eps=0.2, eps_high=0.28, apply="trace"):
    """GRPO-λ's aggregated loss, ϵ-trace or (apply "weight") the ablation's ϵ-weight, as grpo_lambda.py calls them."""
    token_loss = weight_variant() if apply == "weight" else gl.grpo_lambda_token_loss
    cfg = gl.LambdaConfig(lam, 1.0, style, epsilon=eps, epsilon_high=eps_high)
    per_token, _, _ = token_loss(logp, old, A, mask.float(), cfg)
    return common.aggregate_loss(per_token, mask.float(), agg, 48, mask.sum().item(), mask.shape[0])


def off_policy_batch(seed=0, lengths=(5, 1, 9, 0, 12), dtype=torch.float32):
    """Random log-probs with requires_grad, old log-probs 0.3 nats away (so the clip is active), mixed-sign A."""
    g = torch.Generator().manual_seed(seed)
    mask = right_padded(list(lengths))
    logp = (-3 * torch.rand(mask.shape, generator=g, dtype=dtype)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(mask.shape, generator=g, dtype=dtype)
    A = torch.randn(len(lengths), 1, generator=g, dtype=dtype).expand(mask.shape)
    return logp, old, A, mask


# ---------------------------------------------------------------------------------------------- the trace
@pytest.mark.parametrize("style", ["recent", "both"])
@pytest.mark.parametrize("a", [0.0, 0.5, 0.99, 1.0])
def test_trace_equals_matrix_reference(style, a):
    g = torch.Generator().manual_seed(1)
    lengths = [0, 1, 2, 3, 7, 8, 64, 65, 129, 300]
    mask = right_padded(lengths, 305)
    x = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    x[mask == 0] = float("nan")  # padding must not leak, whatever it holds
    for chunk in (64, 3):  # 3: several levels of the chunked recurrence
        z = gl.trace_log_ratio(x, mask, a, 1.0, style, chunk=chunk)
        assert z.dtype == torch.float64 and z.shape == x.shape
        for i, L in enumerate(lengths):
            ref = weight_matrix(L, a, style) @ x[i, :L]
            assert torch.allclose(z[i, :L], ref, rtol=1e-10, atol=1e-10), (style, a, chunk, L)
            assert torch.equal(z[i, L:], torch.zeros(305 - L, dtype=torch.float64))
    # the recurrence's gradient is the transposed trace: d(sum_t g_t z_t)/dx_k = sum_t g_t w(t, k)
    xs = x.nan_to_num(0.0).requires_grad_()
    gz = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    (gl.trace_log_ratio(xs, mask, a, 1.0, style) * gz).sum().backward()
    L = lengths[-1]
    assert torch.allclose(xs.grad[-1, :L], gz[-1, :L] @ weight_matrix(L, a, style), rtol=1e-10, atol=1e-10)
    assert torch.equal(xs.grad[-1, L:], torch.zeros(305 - L, dtype=torch.float64))


def test_trace_gamma_and_lam_enter_as_their_product():
    x = torch.randn(3, 20, dtype=torch.float64)
    mask = right_padded([20, 11, 4])
    z = gl.trace_log_ratio(x, mask, 0.9, 0.5, "both")
    assert torch.allclose(z, gl.trace_log_ratio(x, mask, 0.45, 1.0, "both"))
    assert torch.allclose(z[0], weight_matrix(20, 0.45, "both") @ x[0])
    assert not torch.allclose(z, gl.trace_log_ratio(x, mask, 0.9, 1.0, "both"))


@pytest.mark.parametrize("style", ["recent", "both"])
@pytest.mark.parametrize("a", [0.0, 0.5, 0.99, 1.0])
def test_trace_multipliers_are_the_column_sums(style, a):
    lengths = [1, 2, 3, 10, 11, 256, 0]
    c = trace_multipliers(torch.tensor(lengths), a, 1.0, style, dtype=torch.float64)
    assert c.shape == (7, 256)
    for i, L in enumerate(lengths):
        assert torch.allclose(c[i, :L], weight_matrix(L, a, style).sum(0), rtol=1e-12), (style, a, L)
        assert (c[i, L:] == 0).all()
    assert trace_multipliers(torch.tensor(lengths), a, 1.0, style, T=300).shape == (7, 300)


def test_trace_multipliers_match_the_spec_numbers():
    """Spec §1.3 table (γ = 1, λ = 0.99): c_0, c_{T/2}, c_{T−1}, mean c."""
    for T, style, c0, cmid, mean in [
        (256, "recent", 92.4, 72.4, 64.3),
        (256, "both", 256, 72.4, 87.8),
        (768, "recent", 100.0, 97.9, 87.1),
        (768, "both", 768, 97.9, 149.4),
    ]:
        c = trace_multipliers(torch.tensor([T]), 0.99, 1.0, style)[0]
        assert abs(c[0] - c0) < 0.06 and abs(c[T // 2] - cmid) < 0.06 and c[-1] == 1, (T, style)
        assert abs(c.mean() - mean) < 0.06, (T, style, c.mean())
    k = torch.arange(40, dtype=torch.float64)  # closed form of the recent style
    assert torch.allclose(
        trace_multipliers(torch.tensor([40]), 0.7, 1.0, "recent", dtype=torch.float64)[0],
        (1 - 0.7 ** (40 - k)) / 0.3,
    )


# ------------------------------------------------------------------------------------------ the GRPO limit
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_recent_lambda_zero_is_exactly_grpo(agg):
    logp, old, A, mask = off_policy_batch()
    loss_grpo = grpo_loss(logp, old, A, mask, agg)
    (g_grpo,) = torch.autograd.grad(loss_grpo, logp)
    loss = lambda_loss(logp, old, A, mask, agg, lam=0.0, style="recent")
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.equal(loss, loss_grpo)
    assert torch.equal(g, g_grpo)
    ratio = torch.exp(logp - old)  # the comparison exercises the clip: some tokens are outside [0.8, 1.28]
    assert ((ratio < 0.8) | (ratio > 1.28))[mask.bool()].any()
    # λ must reach the loss: at λ = 0.99 the gradient is different
    (g99,) = torch.autograd.grad(lambda_loss(logp, old, A, mask, agg, lam=0.99, style="recent"), logp)
    assert not torch.allclose(g99, g_grpo, atol=1e-4)


def test_both_lambda_zero_is_not_grpo_first_token_stays_in_every_row():
    logp, old, A, mask = off_policy_batch()
    x = (logp - old).detach()
    z = gl.trace_log_ratio(x, mask, 0.0, 1.0, "both")
    expect = torch.where(mask.bool(), x + x[:, :1], 0.0)  # w(t, 0) = 1 for every t, w(t, t) = 1, else 0
    expect[:, 0] = x[:, 0] * mask[:, 0]
    assert torch.allclose(z, expect, atol=1e-6)
    c = trace_multipliers(mask.sum(1), 0.0, 1.0, "both")
    assert torch.equal(c[:, 0], mask.sum(1).float()) and (c[:, 1:][mask[:, 1:].bool()] == 1).all()
    (g_grpo,) = torch.autograd.grad(grpo_loss(logp, old, A, mask, "token-mean"), logp)
    (g,) = torch.autograd.grad(lambda_loss(logp, old, A, mask, "token-mean", lam=0.0, style="both"), logp)
    assert not torch.allclose(g, g_grpo, atol=1e-4)


# ------------------------------------------------------------------------- on-policy: GRPO with A·c_k (§6)
def linear_policy_logp(theta, feats, tokens):
    """log π_θ(y_t) for a softmax policy whose logits are feats_t · θ: every position shares θ."""
    return torch.log_softmax(feats @ theta, -1).gather(-1, tokens[..., None]).squeeze(-1)


@pytest.mark.parametrize("style", ["recent", "both"])
@pytest.mark.parametrize("lam", [0.5, 0.99])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_on_policy_gradient_is_grpo_with_multipliers(style, lam, agg):
    g = torch.Generator().manual_seed(3)
    lengths = [7, 3, 1, 12, 0]
    mask = right_padded(lengths)
    B, T, D, V = len(lengths), mask.shape[1], 5, 11
    feats = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    theta0 = torch.randn(D, V, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.3, -0.7, 0.4, -2.0, 0.9], dtype=torch.float64)
    A = gl.clamp_negative_advantages(adv, -0.1)[:, None].expand(B, T)

    def grads(theta, old):
        theta = theta.clone().requires_grad_()
        logp = linear_policy_logp(theta, feats, tokens)
        (g1,) = torch.autograd.grad(lambda_loss(logp, old, A, mask, agg, lam, style), theta, retain_graph=True)
        # the GRPO-style surrogate with per-token advantage A·c_k, c detached
        c = trace_multipliers(mask.sum(1), lam, 1.0, style, T=T, dtype=torch.float64)
        ref = common.aggregate_loss(-(A * c) * logp, mask.double(), agg, 48, mask.sum().item(), B)
        (g2,) = torch.autograd.grad(ref, theta)
        return g1, g2

    old = linear_policy_logp(theta0, feats, tokens).detach()
    g1, g2 = grads(theta0, old)
    assert torch.allclose(g1, g2, rtol=1e-6, atol=1e-9)
    assert g1.abs().max() > 1e-3
    # GRPO's on-policy gradient is the same surrogate with c = 1: the multipliers change the gradient
    theta = theta0.clone().requires_grad_()
    (g_grpo,) = torch.autograd.grad(grpo_loss(linear_policy_logp(theta, feats, tokens), old, A, mask, agg), theta)
    assert not torch.allclose(g1, g_grpo, rtol=0.05, atol=1e-6)
    # away from θ_old the traced ratio is not a reweighted GRPO: the two gradients differ
    g1_off, g2_off = grads(theta0 + 0.3 * torch.randn(D, V, generator=g, dtype=torch.float64), old)
    assert not torch.allclose(g1_off, g2_off, rtol=1e-3, atol=1e-6)


# ------------------------------------------------------------------------------------------ the clamp
def test_adv_clamp_only_touches_negative_advantages():
    adv = torch.tensor([-3.0, -0.1, -0.05, 0.0, 0.05, 0.1, 2.5])
    out = gl.clamp_negative_advantages(adv, -0.1)
    assert torch.equal(out, torch.tensor([-0.1, -0.1, -0.05, 0.0, 0.05, 0.1, 2.5]))
    r = torch.randn(1000)
    out = gl.clamp_negative_advantages(r, -0.1)
    assert torch.equal(out[r >= 0], r[r >= 0])  # positives untouched, bit for bit
    assert torch.equal(out[r < 0], torch.maximum(r[r < 0], torch.tensor(-0.1)))
    assert (out[r < -0.1] == -0.1).all() and (r < -0.1).any()
    none = gl.clamp_negative_advantages(r, None)
    assert torch.equal(none, r) and none is not r
    with pytest.raises(ValueError, match="must be <= 0"):
        gl.clamp_negative_advantages(r, 0.5)


# ------------------------------------------------------------------------------------ ϵ-weight variant
def weight_variant():
    """--trace-apply weight's loss (rlvr_utils/methods/lambda_ablations.py), with grpo_lambda_token_loss's arguments."""
    args = runtime.ablated(gl.Args, "lambda_ablations", "trace_apply")(trace_apply="weight")
    return lambda_ablations.token_loss(args, gl.grpo_lambda_token_loss, gl.trace_log_ratio)


def test_weight_variant_is_clipped_grpo_loss_times_eligibility():
    logp, old, A, mask = off_policy_batch(seed=5)
    loss, ratio, _ = weight_variant()(logp, old, A, mask, gl.LambdaConfig(0.9, 1.0, "recent"))
    grpo_tok = -torch.min(torch.exp(logp - old) * A, torch.clamp(torch.exp(logp - old), 0.8, 1.2) * A)
    E = torch.stack([weight_matrix(mask.shape[1], 0.9, "recent").float() @ (1 + torch.sigmoid(r - 1)) for r in logp])
    m = mask.bool()
    assert torch.allclose(loss[m], (grpo_tok * E)[m], rtol=1e-5)
    assert torch.allclose(ratio, torch.exp(logp - old))
    # E is not detached: the gradient differs from the one with E held fixed
    (g,) = torch.autograd.grad((loss * mask).sum(), logp)
    (g_fixed,) = torch.autograd.grad((grpo_tok * E.detach() * mask).sum(), logp)
    assert not torch.allclose(g, g_fixed, atol=1e-4)


# ------------------------------------------------------------------------------------------- bad input
def test_long_sequences_short_rows_and_padding_stay_finite():
    B, T = 4, 20_000
    mask = right_padded([T, 1, 0, 5000], T)
    logp = torch.full((B, T), -0.5, requires_grad=True)
    old = torch.full((B, T), -1.5)  # +1 nat per token: the γλ = 1 trace reaches 20000
    A = torch.tensor([1.0, -0.1, 0.5, -0.1])[:, None].expand(B, T)
    for lam, style in [(1.0, "both"), (0.99, "both"), (1.0, "recent")]:
        loss, ratio, z = gl.grpo_lambda_token_loss(logp, old, A, mask, gl.LambdaConfig(lam, 1.0, style))
        assert (
            torch.isfinite(loss).all() and torch.isfinite(ratio).all() and ratio.max() <= torch.exp(torch.tensor(20.0))
        )
        total = common.aggregate_loss(loss, mask.float(), "token-mean")
        (g,) = torch.autograd.grad(total, logp)
        assert torch.isfinite(total) and torch.isfinite(g).all()
        assert (z[2] == 0).all() and (g[2] == 0).all() and (ratio[2] == 1).all()  # all-padding row
        assert z[1, 0] == 1.0 and (z[1, 1:] == 0).all()  # length 1: z_0 = x_0
    z = gl.trace_log_ratio(old.new_ones(B, T), mask, 1.0, 1.0, "recent")
    assert z[0, -1] == T and z.dtype == torch.float32  # exact count, float32
    zh = gl.trace_log_ratio(torch.ones(2, 3000, dtype=torch.bfloat16), torch.ones(2, 3000), 1.0, 1.0, "recent")
    assert zh.dtype == torch.float32 and zh[0, -1] == 3000  # bf16 input accumulates in float32
    # memory is O(B·T): a [T, T] matrix at T = 300k would need 360 GB
    z = gl.trace_log_ratio(torch.randn(1, 300_000), torch.ones(1, 300_000), 0.99, 1.0, "both")
    assert torch.isfinite(z).all()


def test_bad_arguments_raise():
    x, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="unknown trace style"):
        gl.trace_log_ratio(x, mask, 0.9, 1.0, "early")
    with pytest.raises(ValueError, match=r"gamma \* lam must be in \[0, 1\]"):
        gl.trace_log_ratio(x, mask, 1.5, 1.0, "recent")
    assert gl.trace_log_ratio(torch.zeros(3, 0), torch.zeros(3, 0), 0.9).shape == (3, 0)
    assert trace_multipliers(torch.tensor([], dtype=torch.long), 0.9).shape == (0, 0)


# ------------------------------------------------------------------------------------------ the script
@pytest.mark.slow
def test_grpo_lambda_two_steps_subprocess(tmp_path):
    out = run_script("grpo_lambda.py", "--total-steps", "2", "--output-dir", str(tmp_path), *FAST)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "reward",
        "policy_loss",
        "grad_norm",
        "clip_ratio/region_mean",
        "trace/log_ratio_mean",
        "trace/log_ratio_max",
        "trace/clamped_frac",
        "trace/multiplier_mean",
        "time/update",
    ):
        assert key in rows[1], key
    assert rows[1]["trace/multiplier_mean"] >= 1.0  # "both" at λ = 0.99: every token's c_k >= 1
    assert "eval/accuracy" in rows[2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        [
            "--trace-apply",
            "weight",
            "--trace-style",
            "recent",
            "--adv-clamp",
            "-0.5",
            "--num-iterations",
            "2",
            "--beta",
            "0.04",
            "--micro-batch-size",
            "5",
        ]
    ],
)
def test_grpo_lambda_variant_runs(tmp_path, flags):
    run_inprocess("grpo_lambda.py", "--total-steps", "1", "--output-dir", str(tmp_path), *FAST, *flags)
    rows = read_metrics(tmp_path)
    assert all(all(isinstance(v, (int, float)) and v == v for v in r.values()) for r in rows)  # no NaN
    cfg = json.loads((run_dir(tmp_path) / "config.json").read_text())
    assert cfg["trace_apply"] == "weight" and cfg["adv_clamp"] == "-0.5" and rows[1]["kl"] >= 0.0
