"""Each method's loss checked against an independent reference: a hand-computed value or a closed form, through the
real training step of the script (run in-process, with common's functions wrapped to feed known values or to
record what reaches the loss). These tests do not reuse the function under test to build their expectation."""

import itertools
import math

import pytest
import torch
from helpers import read_metrics, run_inprocess

import common
import ep_grpo
from rlvr_utils.core import tasks

FAST = [
    "--num-eval",
    "2",
    "--eval-every",
    "0",
    "--prompts-per-step",
    "2",
    "--num-generations",
    "4",
    "--max-new-tokens",
    "16",
    "--micro-batch-size",
    "64",
]


def _capture_loss(monkeypatch):
    """Every (per-token loss, mask) that reaches common.aggregate_loss."""
    seen, real = [], common.aggregate_loss

    def agg(per_token, mask, *a, **k):
        seen.append((per_token.detach().clone(), mask.detach().clone()))
        return real(per_token, mask, *a, **k)

    monkeypatch.setattr(common, "aggregate_loss", agg)
    return seen


def _reward_task(monkeypatch, fn):
    """The task's reward replaced by fn(call index, example)."""
    real, calls = tasks.load_task, itertools.count()

    def load(*a, **k):
        t = real(*a, **k)
        t.reward_fn = lambda completion, ex: fn(next(calls), ex)
        return t

    monkeypatch.setattr(tasks, "load_task", load)


@pytest.mark.slow
def test_grpo_clipped_surrogate_and_k3_kl_against_hand_values(tmp_path, monkeypatch):
    """grpo.py with mu = 2, beta = 0.1, eps 0.2 / 0.28: the log-probs are set by hand (old -1, reference -1.2, current
    old + d with d cycling 0.5, -0.5, 0.1 along the tokens) and every row's advantage is +1 or -1 in turn. Hand values:
      A=+1: d=.5 -> ratio e^.5=1.6487 clipped to 1.28 -> -1.28;  d=-.5 -> -0.6065;  d=.1 -> -1.1052
      A=-1: d=.5 -> +1.6487;  d=-.5 -> ratio 0.6065 clipped to 0.8 -> +0.8;  d=.1 -> +1.1052
      plus 0.1 * (e^x - x - 1) with x = log pi_ref - log pi = -0.2 - d."""
    calls = []

    def lp(model, ids, attn, T, temperature=1.0, with_entropy=False, **k):
        calls.append(torch.is_grad_enabled())
        d = torch.tensor([0.5, -0.5, 0.1]).repeat(T)[:T].expand(ids.shape[0], T)
        if not torch.is_grad_enabled():  # the old pass, then the reference pass
            return (torch.full((ids.shape[0], T), -1.0 if sum(not c for c in calls) == 1 else -1.2), None)
        leaf = (-1.0 + d).clone().requires_grad_(True)
        return leaf * 1.0, torch.zeros_like(leaf) if with_entropy else None

    monkeypatch.setattr(common, "token_logprobs", lp)
    monkeypatch.setattr(
        common, "group_advantages", lambda r, *a, **k: torch.tensor([1.0, -1.0]).repeat(len(r))[: len(r)]
    )
    seen = _capture_loss(monkeypatch)
    run_inprocess(
        "grpo.py",
        "--total-steps",
        "1",
        "--output-dir",
        str(tmp_path),
        "--num-iterations",
        "2",
        "--beta",
        "0.1",
        "--epsilon-high",
        "0.28",
        *FAST,
    )
    hand = {
        (1, 0.5): -1.28,
        (1, -0.5): -math.exp(-0.5),
        (1, 0.1): -math.exp(0.1),
        (-1, 0.5): math.exp(0.5),
        (-1, -0.5): 0.8,
        (-1, 0.1): math.exp(0.1),
    }
    assert len(seen) == 2  # one micro-batch, two passes
    for per_token, mask in seen:
        for i, j in itertools.product(range(per_token.shape[0]), range(per_token.shape[1])):
            d = [0.5, -0.5, 0.1][j % 3]
            x = -1.2 - (-1.0 + d)
            want = hand[(1 if i % 2 == 0 else -1, d)] + 0.1 * (math.exp(x) - x - 1)
            assert per_token[i, j].item() == pytest.approx(want, abs=1e-5), (i, j)


@pytest.mark.slow
def test_sc_grpo_solve_none_rows_carry_alpha_times_zscore_and_nothing_past_the_reference(tmp_path, monkeypatch):
    """A batch of one solve-none group (every reward 0) and one partial group. On-policy the per-token loss is
    -f * A: the reference rollout o_r gets exactly 0, tokens past L_i = min(|o_i|, |o_r|) get 0, and the solve-none
    rows' losses are linear in alpha (alpha * z(s) reaches the loss; alpha 0 leaves nothing) while the partial group's
    do not move."""

    def reward(i, ex):  # training calls in order (eval prompts have ids >= 1e9): the first group of 4 all wrong, the
        if ex.id >= 10**9:  # second mixed (2 right)
            return 0.0
        n = train_calls[0] = train_calls[0] + 1
        return 0.0 if n <= 4 else float(n % 2)

    losses = {}
    for alpha in (0.1, 0.2, 0.0):
        train_calls = [0]
        _reward_task(monkeypatch, reward)
        seen = _capture_loss(monkeypatch)
        run_inprocess(
            "sc_grpo.py",
            "--total-steps",
            "1",
            "--output-dir",
            str(tmp_path / str(alpha)),
            "--alpha",
            str(alpha),
            *FAST,
            "--temperature",
            "1.5",
            "--max-new-tokens",
            "40",
        )
        ((per_token, mask),) = seen
        losses[alpha] = (per_token, mask)
        assert read_metrics(tmp_path / str(alpha))[1]["sc/groups_none"] == 0.5
    per_token, mask = losses[0.1]
    none_rows = per_token[:4] * mask[:4]
    zero_rows = [i for i in range(4) if (none_rows[i] == 0).all()]
    assert len(zero_rows) >= 1  # o_r
    lengths = mask[:4].sum(1)
    r = zero_rows[0]
    for i in range(4):
        if i != r:
            assert (none_rows[i, int(min(lengths[i], lengths[r])) :] == 0).all()  # nothing past L_i
    assert torch.allclose(losses[0.2][0][:4] * mask[:4], 2 * none_rows, atol=1e-6) and none_rows.abs().sum() > 0
    assert (losses[0.0][0][:4] * mask[:4] == 0).all()
    assert torch.allclose(losses[0.2][0][4:], per_token[4:]) and per_token[4:].abs().sum() > 0  # the partial group


def test_ep_grpo_gate_and_process_signal_together_against_a_hand_value():
    """G = 2, T = 2, one progress window. Entropies 0 and 1 in each response -> tau = 1 (the 0.8-quantile of
    {0, 0, 1, 1}); soft gate 1 + sigmoid((H - 1) / 0.1) = 1.0000454 and 1.5, over their mean per response.
    delta sums 0 and 0.6 -> P = -1, +1 (population z-score); rewards 1, 0 -> A_out = +-1 / (1 + 2e-6);
    A = gate * (A_out + 0.5 P)."""
    from ep_grpo import EPConfig, ep_advantages
    from rlvr_utils.core import runtime
    from rlvr_utils.methods import ep_ablations

    H = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    logp_old = torch.tensor([[0.1, -0.1], [0.2, 0.4]])
    flags = dict(num_buckets=1, gate_alpha=1.0, gate_temp=0.1, process_coef=0.5, process_polarity="none")
    args = runtime.ablated(ep_grpo.Args, "ep_ablations", "gate")(**flags, process_granularity="window")  # an ablation
    A = ep_ablations.wrap(args, vars(ep_grpo))(
        H, logp_old, torch.zeros(2, 2), torch.ones(2, 2), torch.tensor([1.0, 0.0]), 2, cfg=EPConfig.of(args)
    )
    g0, g1 = 1 + 1 / (1 + math.exp(10)), 1.5
    gate = [g0 / ((g0 + g1) / 2), g1 / ((g0 + g1) / 2)]
    a_out = 0.5 / (0.5 + 1e-6)
    want = [[gate[0] * (a_out - 0.5), gate[1] * (a_out - 0.5)], [gate[0] * (-a_out + 0.5), gate[1] * (-a_out + 0.5)]]
    assert torch.allclose(A, torch.tensor(want), atol=1e-6)
    assert abs(gate[0] - 1.0) > 0.1  # the gate is not 1 and the process term is not 0: both act
    # the defaults: per-token z-score in the window and outcome polarity. delta = (0.1, -0.1 | 0.2, 0.4): mean 0.15,
    # population std sqrt(0.0325) -> z = (-0.05, -0.25 | 0.05, 0.25) / 0.180278; d = +1 (r = 1), -1 (r = 0); lambda 0.2
    cfg = EPConfig(num_buckets=1)
    A = ep_advantages(H, logp_old, torch.zeros(2, 2), torch.ones(2, 2), torch.tensor([1.0, 0.0]), 2, cfg=cfg)
    z = [[-0.05 / 0.0325**0.5, -0.25 / 0.0325**0.5], [0.05 / 0.0325**0.5, 0.25 / 0.0325**0.5]]
    want = [
        [gate[0] * (a_out + 0.2 * z[0][0]), gate[1] * (a_out + 0.2 * z[0][1])],
        [gate[0] * (-a_out - 0.2 * z[1][0]), gate[1] * (-a_out - 0.2 * z[1][1])],
    ]
    assert torch.allclose(A, torch.tensor(want), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("lam", [0.99, 0.5])
def test_grpo_lambda_logged_multiplier_is_the_losss_credit(tmp_path, monkeypatch, lam):
    """On-policy, the gradient of GRPO-lambda's loss on log p_k is GRPO's times c_k = sum_{t>=k} w(t, k) (closed form
    for "both": min(k, L-1-k) + 1 terms of the geometric sum plus a^k (L-1-2k)). The logged trace/multiplier_mean is
    measured on the loss's gradient; here every advantage is +1, so it is the mean closed-form c_k over all tokens."""
    monkeypatch.setattr(common, "group_advantages", lambda r, *a, **k: torch.ones(len(r)))
    seen = _capture_loss(monkeypatch)
    run_inprocess("grpo_lambda.py", "--total-steps", "1", "--output-dir", str(tmp_path), "--lam", str(lam), *FAST)
    ((_, mask),) = seen
    a, cs = lam, []
    for L in mask.sum(1).long().tolist():
        for k in range(L):
            n = min(k, L - 1 - k) + 1
            cs.append((1 - a**n) / (1 - a) + a**k * max(0, L - 1 - 2 * k))
    logged = read_metrics(tmp_path)[1]["trace/multiplier_mean"]
    assert logged == pytest.approx(sum(cs) / len(cs), rel=1e-4)


@pytest.mark.slow
def test_grpo_lambda_negative_advantage_clamp_through_the_script(tmp_path, monkeypatch):
    """Advantages forced to +1 and -3 in turn: on-policy (traced ratio exp(0) = 1, beta 0) the per-token loss is -A
    after the clamp at -0.1, so exactly -1.0 and +0.1 (paper: negative advantages clamped at -0.1)."""
    monkeypatch.setattr(
        common, "group_advantages", lambda r, *a, **k: torch.tensor([1.0, -3.0]).repeat(len(r))[: len(r)]
    )
    seen = _capture_loss(monkeypatch)
    run_inprocess("grpo_lambda.py", "--total-steps", "1", "--output-dir", str(tmp_path), *FAST)
    ((per_token, mask),) = seen
    m = mask.bool()
    assert torch.allclose(per_token[0::2][m[0::2]], torch.tensor(-1.0), atol=1e-6)
    assert torch.allclose(per_token[1::2][m[1::2]], torch.tensor(0.1), atol=1e-6)


@pytest.mark.slow
def test_sc_grpo_partial_group_loss_is_minus_f_times_a_from_an_independent_recomputation(tmp_path, monkeypatch):
    """One on-policy SC-GRPO step: one all-wrong group and one partial group (rows 1 and 3 of 4 right). D is recomputed
    here from unpadded forwards of the policy as it sampled (float64): prompt + o_i against teacher prompt + o_i,
    the full-vocabulary KL(teacher || student) at each completion token. c = max(P75 of D over the active tokens of
    the micro-batch, 1e-4), f = D / (D + c); the partial rows' per-token loss is -f * A at every completion token,
    A = (r - mean) / (population std + 1e-6); the solve-none rows' is -f * alpha * z(s), s = mean f over L_i tokens."""
    import copy

    import numpy as np

    def reward(i, ex):
        if ex.id >= 10**9:  # evaluation prompts
            return 0.0
        n = train_calls[0] = train_calls[0] + 1
        return 0.0 if n <= 4 else float(n % 2 == 0)  # rows 5, 7 (1-based) of the second group are right

    train_calls, captured, teacher_texts = [0], {}, []
    _reward_task(monkeypatch, reward)
    seen = _capture_loss(monkeypatch)
    real_load, real_rollouts, real_encode = common.load_model, common.rollouts_with_rewards, tasks.encode_prompt

    def load(*a, **k):
        model = real_load(*a, **k)
        captured["model"] = copy.deepcopy(model).double()  # the policy that samples step 1
        return model

    def rollouts(*a, **k):
        out = real_rollouts(*a, **k)
        captured["ro"], captured["rewards"] = out[0], out[1]
        return out

    def encode(tok, text, *limit):
        ids = real_encode(tok, text, *limit)
        if text.startswith("Reference solution:"):
            teacher_texts.append((text, ids))
        return ids

    monkeypatch.setattr(common, "load_model", load)
    monkeypatch.setattr(common, "rollouts_with_rewards", rollouts)
    monkeypatch.setattr(tasks, "encode_prompt", encode)
    run_inprocess("sc_grpo.py", "--total-steps", "1", "--output-dir", str(tmp_path), *FAST)
    ((per_token, mask),) = seen
    model, ro = captured["model"], captured["ro"]
    assert captured["rewards"].tolist() == [0, 0, 0, 0, 0, 1, 0, 1]
    L = ro.completion_mask.sum(1).long().tolist()
    texts = [t.strip() for t in ro.texts]
    tau = lambda text: text.split("\n", 1)[1].rsplit("\nSolve: ", 1)[0].strip()  # noqa: E731
    # who is whose reference: group 0 rows other than o_r, then every row of group 1, in row order
    o_r = [r for r in range(4) if (per_token[r] == 0).all() and texts[r] == tau(teacher_texts[0][0])][0]
    rows = [r for r in range(4) if r != o_r] + [4, 5, 6, 7]
    assert len(teacher_texts) == len(rows)
    refs = {i: ([j for j in range(8) if texts[j] == tau(text)], ids) for i, (text, ids) in zip(rows, teacher_texts)}
    assert all(set(refs[i][0]) & ({5, 7} - {i}) for i in (4, 5, 6, 7))  # partial rows: a right sibling, not itself

    def log_softmax_at_completion(prompt_ids, i):
        comp = ro.completion_ids[i, : L[i]].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + comp])).logits[0, -L[i] - 1 : -1]
        return logits.double().log_softmax(-1)

    D = torch.zeros(8, per_token.shape[1], dtype=torch.float64)
    active = torch.zeros_like(D, dtype=torch.bool)
    for i in rows:
        student = log_softmax_at_completion(ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist(), i)
        teacher = log_softmax_at_completion(refs[i][1], i)
        D[i, : L[i]] = (teacher.exp() * (teacher - student)).sum(-1)
        active[i, : (L[i] if i >= 4 else min(L[i], L[o_r]))] = True
    c = max(float(np.percentile(D[active].numpy(), 75)), 1e-4)
    f = torch.where(active, D / (D + c), 0.0)
    assert D[4:][active[4:]].mean() > 1e-4 and 0 < f.max() < 1
    r = torch.tensor([0, 1, 0, 1], dtype=torch.float64)
    A = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    for k, i in enumerate(range(4, 8)):
        m = mask[i].bool()
        assert torch.allclose(per_token[i][m].double(), -f[i][m] * A[k], rtol=1e-4, atol=2e-5), i  # fp32 D near 0
    s = torch.tensor([f[i][active[i]].mean().item() for i in rows[:3]], dtype=torch.float64)
    z = 0.1 * (s - s.mean()) / (s.std(unbiased=False) + 1e-6)
    for k, i in enumerate(rows[:3]):
        m = mask[i].bool()
        assert torch.allclose(per_token[i][m].double(), -f[i][m] * z[k], rtol=1e-3, atol=2e-5), i
    assert (per_token[o_r] == 0).all()
