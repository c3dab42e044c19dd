"""sc_grpo.py: its pure functions (weights, routing, credit), its teacher (rlvr_utils/methods/teacher.py: prompts, KL,
bad inputs) and its real entry point."""

import copy
import dataclasses
import itertools

import pytest
import torch
from helpers import read_metrics, run_inprocess, run_script

import common
import sc_grpo
from rlvr_utils.core import logprob_kernels, tasks
from rlvr_utils.methods import sc_ablations, teacher
from sc_grpo import Role


def reference_prompt(problem: tasks.ArithProblem, reference: str) -> str:
    """The teacher's plain-text prompt on the built-in task, written out: the block the tiny model was trained on."""
    return f"Reference solution:\n{reference.strip()}\nSolve: {problem.text}\n"


def logprobs_and_kl(model, ids, attn, T, temperature=1.0, teach=None, pad_id=0, with_entropy=False, kl_grad=False,
                    chunk_size=None, fused=None, divergence=None):  # fmt: skip
    """As sc_grpo.py's step 5: common.token_logprobs keeps its forward's output (`keep`), teacher.teacher_kl adds the
    teacher's. fused=False: as on a model whose logits are not lm_head(h) (rlvr_utils/extras/unfused.py), for both."""
    fused_ok = logprob_kernels.fused_logprobs_ok
    student, teach = [], teach if teach is not None else [None] * len(ids)
    try:
        logprob_kernels.fused_logprobs_ok = fused_ok if fused is not False else (lambda model: False)
        logp, ent = common.token_logprobs(model, ids, attn, T, temperature, chunk_size, with_entropy, keep=student)
        D, cost = teacher.teacher_kl(
            model, student, ids, attn, T, teach, temperature, pad_id, kl_grad, None, divergence
        )
    finally:
        logprob_kernels.fused_logprobs_ok = fused_ok
    return logp, ent, D, cost


REAL_LOAD_TASK, REAL_CLIP = tasks.load_task, torch.nn.utils.clip_grad_norm_
NEW_METRICS = (
    "sc/kl_mean",
    "sc/kl_p75",
    "sc/kl_p95",
    "sc/weight_mean",
    "sc/groups_partial",
    "sc/groups_none",
    "sc/groups_plain",
    "time/teacher",
    "sc/tau_truncated",
    "sc/no_reference",
    "sc/empty_completions",
)


# --- kl_weights ----------------------------------------------------------------------------------
def test_kl_weights_hand_cases():
    kl = torch.tensor([[0.0, 1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    f = sc_grpo.kl_weights(kl, mask)  # P75 of [0, 1, 2, 3] (linear interpolation) = 2.25
    assert torch.allclose(f, torch.tensor([[0.0, 1 / 3.25, 2 / 4.25, 3 / 5.25, 0.0]]))
    assert ((f >= 0) & (f < 1)).all() and f[0, 4] == 0  # range [0, 1); the masked token gets 0, not 50/52.25
    f50 = sc_grpo.kl_weights(kl, mask, percentile=50.0)  # median 1.5: the token at the median gets f = 0.5
    assert torch.allclose(f50[0, :4], torch.tensor([0.0, 1 / 2.5, 2 / 3.5, 3 / 4.5]))
    tiny = torch.tensor([[1e-6, 2e-6, 4e-6]])  # P75 = 3e-6 < c_min: the floor takes over
    assert torch.allclose(sc_grpo.kl_weights(tiny, torch.ones(1, 3)), tiny / (tiny + 1e-4))
    assert torch.allclose(sc_grpo.kl_weights(tiny, torch.ones(1, 3), c_min=1e-7), tiny / (tiny + 3e-6))


def test_kl_weights_is_never_nan_and_detached():
    kl = torch.tensor([[float("nan"), float("inf"), -1e-7, 0.5]], requires_grad=False)
    f = sc_grpo.kl_weights(kl, torch.ones(1, 4))
    assert torch.isfinite(f).all() and f[0, 0] == 0 and f[0, 2] == 0 and 0.99 < f[0, 1] <= 1
    assert (sc_grpo.kl_weights(torch.rand(2, 3), torch.zeros(2, 3)) == 0).all()  # no active token: all 0
    x = torch.rand(2, 3, requires_grad=True)
    assert not sc_grpo.kl_weights(x * 2, torch.ones(2, 3)).requires_grad


# --- route_groups --------------------------------------------------------------------------------
def test_route_groups_never_self_and_plain_for_one_or_all_correct():
    G = 4
    # groups keyed by id, interleaved in the batch: ids 7 (n_c = 2), 3 (n_c = 0), 9 (n_c = 1), 5 (n_c = 4), 2 (n_c = 3)
    ids = torch.tensor([7, 3, 9, 5, 2] * G)
    n_correct = {7: 2, 3: 0, 9: 1, 5: 4, 2: 3}
    rank = [int((ids[:i] == ids[i]).sum()) for i in range(len(ids))]  # position within its group
    correct = torch.tensor([rank[i] < n_correct[int(ids[i])] for i in range(len(ids))])
    counts = torch.zeros(len(ids), len(ids))
    for seed in range(200):
        modes, ref = sc_grpo.route_groups(correct, G, torch.Generator().manual_seed(seed), ids)
        assert modes == ["partial", "none", "plain", "plain", "partial"]  # first-appearance order: 7, 3, 9, 5, 2
        for i in range(len(ids)):
            g = int(ids[i])
            if n_correct[g] in (1, G):
                assert ref[i] == -1
            elif n_correct[g] == 0:
                continue
            else:  # partial: a correct sibling, never itself, for correct and incorrect rollouts alike
                j = int(ref[i])
                assert j != i and ids[j] == g and correct[j]
                counts[i, j] += 1
        (none_rows,) = torch.nonzero(ids == 3, as_tuple=True)
        r = [i for i in none_rows.tolist() if ref[i] == -1]
        assert len(r) == 1 and all(ref[i] == r[0] for i in none_rows.tolist() if i != r[0])
    # group 2 has three correct rollouts: a correct one draws each of the other two about equally often
    row = int(torch.nonzero((ids == 2) & correct)[0])
    drawn = counts[row][counts[row] > 0]
    assert len(drawn) == 2 and drawn.min() > 60


def test_route_groups_ablation_modes_and_determinism():
    correct = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)  # n_c = 1, then n_c = 4 = G
    modes, ref = sc_grpo.route_groups(correct, 4, torch.Generator().manual_seed(0), weighted=("single", "all"))
    assert modes == ["single", "all"]
    assert ref[:4].tolist() == [-1, 0, 0, 0]  # the lone correct rollout has no other correct one to condition on
    assert all(ref[i] != i and 4 <= ref[i] < 8 for i in range(4, 8))
    again = sc_grpo.route_groups(correct, 4, torch.Generator().manual_seed(0), weighted=("single", "all"))[1]
    assert torch.equal(ref, again)
    with pytest.raises(ValueError, match="every group must have 4"):
        sc_grpo.route_groups(correct[:6], 4, torch.Generator(), torch.tensor([0, 0, 0, 0, 1, 1]))


def test_diversity_advantage():
    s = torch.tensor([0.1, 0.3, 0.5, 0.2, 0.2])
    a = sc_grpo.diversity_advantage(s, torch.tensor([1, 1, 1, 2, 2]), alpha=0.1)
    z = (s[:3] - 0.3) / (s[:3].std(unbiased=False) + 1e-6)
    assert torch.allclose(a[:3], 0.1 * z, atol=1e-6) and (a[3:] == 0).all()  # equal scores: 0, not NaN


def test_one_std_convention_for_the_grpo_advantage_and_the_solve_none_zscore():
    """Rewards [1,1,0,0,0,0,0,0]: population std + 1e-6 gives A = (1.7321, -0.5774) (unbiased + 1e-4: (1.62, -0.54));
    the diversity z-score follows the same flag, so the ratio of the two signals does not move with G."""
    assert sc_grpo.Args().outcome_std == "population"
    r = torch.tensor([1.0, 1, 0, 0, 0, 0, 0, 0])
    a = common.group_advantages(r, 8, "group", 1e-6, unbiased=False)  # what step 3 calls at the default
    assert a[0].item() == pytest.approx(1.7321, abs=1e-4) and a[2].item() == pytest.approx(-0.5774, abs=1e-4)
    s, gid = torch.tensor([0.3, 0.1, 0.1, 0.1]), torch.zeros(4, dtype=torch.long)
    pop = sc_grpo.diversity_advantage(s, gid, 1.0)  # (0.2 - 0.05) / sqrt(0.0075)
    assert pop[0].item() == pytest.approx(0.15 / (0.0075**0.5 + 1e-6), rel=1e-6)
    unb = sc_grpo.diversity_advantage(s, gid, 1.0, 1e-4, unbiased=True)  # (0.15) / sqrt(0.01)
    assert unb[0].item() == pytest.approx(0.15 / (0.1 + 1e-4), rel=1e-6)


def test_solve_none_rows_add_the_bonus_to_their_grpo_advantage():
    """A solve-none row keeps its GRPO advantage (non-zero only when --overlong-buffer shaped the rewards) and adds
    alpha * z(s); o_r gets 0."""
    D = torch.tensor([[0.0], [0.2], [0.4], [0.1]])
    role = torch.tensor([Role.REFERENCE, Role.DIVERSITY, Role.DIVERSITY, Role.DIVERSITY])
    gid = torch.zeros(4, dtype=torch.long)
    active = torch.tensor([[0.0], [1], [1], [1]])
    shaped = torch.tensor([[0.5], [-0.25], [0.25], [-0.5]])  # e.g. overlong penalties
    _, adv0, f = sc_grpo.weights_and_advantages(D, active, role, gid, torch.zeros(4, 1))
    _, adv1, _ = sc_grpo.weights_and_advantages(D, active, role, gid, shaped)
    assert adv0[0] == 0 and adv1[0] == 0 and adv0[1:].abs().sum() > 0
    assert torch.allclose(adv1[1:], adv0[1:] + shaped[1:])


def test_token_kl_is_the_full_vocabulary_kl():
    zt, zs = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    want = torch.nn.functional.kl_div(zs.log_softmax(-1), zt.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert torch.allclose(sc_grpo.token_kl(zt, zs), want, atol=1e-6)
    assert (sc_grpo.token_kl(zt, zt) == 0).all()


# --- the teacher pass on the bundled model ------------------------------------------------------------
def _batch(tokenizer, texts_per_prompt, prompts):
    prompt_ids = [tasks.encode_prompt(tokenizer, p) for p in prompts for _ in texts_per_prompt]
    comps = [
        tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for t in texts_per_prompt
    ] * len(prompts)
    p_ids, p_mask = common.pad_left(prompt_ids, tokenizer.pad_token_id)
    T = max(map(len, comps))
    c_ids = torch.tensor([c + [tokenizer.pad_token_id] * (T - len(c)) for c in comps])
    c_mask = torch.tensor([[1] * len(c) + [0] * (T - len(c)) for c in comps])
    return prompt_ids, torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1), T


@pytest.mark.parametrize("fused", [True, False])
def test_logprobs_and_kl_without_teacher_equals_token_logprobs(tiny, fused):
    model, tok = tiny
    _, ids, attn, T = _batch(tok, ["12+3=15\n#### 15", "9-1=8"], ["Solve: 12+3\n", "Solve: 44-7+1\n"] * 5)
    model.zero_grad()
    want, want_ent = common.token_logprobs(model, ids, attn, T, 0.7, with_entropy=True, fused=fused)
    (want.sum()).backward()
    want_grad = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got, got_ent, D, _ = logprobs_and_kl(model, ids, attn, T, 0.7, with_entropy=True, fused=None if fused else False)
    (got.sum()).backward()
    assert torch.equal(got, want) and torch.equal(got_ent, want_ent) and (D == 0).all()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want_grad))
    model.zero_grad()


def test_kl_is_zero_for_the_students_own_context_and_matches_a_direct_computation(tiny):
    model, tok = tiny
    comps = ["12+3=15\n15-4=11\n#### 11", "12+3=16"]
    prompts = ["Solve: 12+3-4\n"]
    prompt_ids, ids, attn, T = _batch(tok, comps, prompts)
    with torch.no_grad():
        _, _, D_same, _ = logprobs_and_kl(model, ids, attn, T, 1.0, prompt_ids, tok.pad_token_id)
        assert D_same.abs().max() < 1e-6  # the teacher sees exactly the student's context
        teach = [tasks.encode_prompt(tok, reference_prompt(tasks.parse_arith_problem("12+3-4"), comps[0]))] * 2
        teach[1] = None  # the second row has no teacher: D = 0 there
        _, _, D, cost = logprobs_and_kl(model, ids, attn, T, 1.0, teach, tok.pad_token_id)
        # direct: one unpadded forward each, full log-softmax
        comp = tok(comps[0], add_special_tokens=False).input_ids + [tok.eos_token_id]
        L = len(comp)
        s_log = model(torch.tensor([prompt_ids[0] + comp])).logits[0, -L - 1 : -1].log_softmax(-1)
        t_log = model(torch.tensor([teach[0] + comp])).logits[0, -L - 1 : -1].log_softmax(-1)
        want = (t_log.exp() * (t_log - s_log)).sum(-1)
    assert torch.allclose(D[0, :L], want, rtol=1e-3, atol=1e-6) and want.mean() > 1e-5
    assert (D[1] == 0).all() and cost["seconds"] > 0


@pytest.mark.parametrize("fused", [True, False])
def test_sampled_logratio_ablation_is_the_teacher_minus_student_log_prob_of_the_sampled_token(tiny, fused):
    """--divergence sampled-logratio (ours): D = log pi_teacher(o_t) - log pi(o_t), from one unpadded forward each."""
    model, tok = tiny
    comps, prompts = ["12+3=15\n15-4=11\n#### 11", "12+3=16"], ["Solve: 12+3-4\n"]
    prompt_ids, ids, attn, T = _batch(tok, comps, prompts)
    ref = reference_prompt(tasks.parse_arith_problem("12+3-4"), comps[0])
    teach = [tasks.encode_prompt(tok, ref), None]
    with torch.no_grad():
        kw = dict(fused=None if fused else False, divergence=sc_ablations.sampled_logratio)
        _, _, D, _ = logprobs_and_kl(model, ids, attn, T, 0.8, teach, tok.pad_token_id, **kw)
        comp = tok(comps[0], add_special_tokens=False).input_ids + [tok.eos_token_id]
        L, tgt = len(comp), torch.tensor(comp)[:, None]
        s_log = (model(torch.tensor([prompt_ids[0] + comp])).logits[0, -L - 1 : -1] / 0.8).log_softmax(-1)
        t_log = (model(torch.tensor([teach[0] + comp])).logits[0, -L - 1 : -1] / 0.8).log_softmax(-1)
        want = (t_log.gather(-1, tgt) - s_log.gather(-1, tgt)).squeeze(-1)
    assert torch.allclose(D[0, :L], want, atol=1e-4) and want.abs().max() > 1e-3 and (D[1] == 0).all()


def test_signed_logratio_hand_cases():
    delta = torch.tensor([[-2.0, 0.5, 0.0], [-2.0, 0.5, 0.0], [-2.0, 0.5, 0.0]])
    got = sc_ablations.signed_logratio(delta, torch.tensor([-1.3, 0.7, 0.0]))
    # A < 0: where the teacher finds the token less likely (2.0); A > 0: more likely (0.5); A = 0: |delta|
    assert torch.equal(got, torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.5, 0.0], [2.0, 0.5, 0.0]]))


@pytest.mark.parametrize("kl_grad", [False, True])
def test_fused_path_gives_the_unfused_d_f_and_gradient_in_float64(tiny, kl_grad):
    """The memory-bounded path (hidden states -> FusedLinearLogProb and FusedLinearKL) against the [b, T, V] logits
    path on the tiny model in float64: the same log-probs, entropy, D, f and gradient of a surrogate loss (plus the
    additive KL term, whose gradient goes through D, with kl_grad)."""
    model, tok = tiny
    m64 = copy.deepcopy(model).double()
    comps = ["12+3=15\n15-4=11\n#### 11", "12+3=16", "12+3=15\n15-4=1", "12+3=15\n15-4=11\n#### 11"]
    prompt_ids, ids, attn, T = _batch(tok, comps, ["Solve: 12+3-4\n"])
    problem = tasks.parse_arith_problem("12+3-4")
    teach = [None] + [tasks.encode_prompt(tok, reference_prompt(problem, t)) for t in (comps[0], comps[0], "15\n11")]
    m = attn[:, -T:].double()
    active = m * torch.tensor([0.0, 1, 1, 1])[:, None]
    A = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)[:, None]
    out = {}
    for fused in (True, False):
        m64.zero_grad()
        logp, ent, D, _ = logprobs_and_kl(
            m64,
            ids,
            attn,
            T,
            0.8,
            teach,
            tok.pad_token_id,
            with_entropy=True,
            kl_grad=kl_grad,
            chunk_size=3,
            fused=fused,
        )  # a row chunk of 3 and 1
        f = sc_grpo.kl_weights(D, active)
        loss = -(torch.exp(logp - logp.detach()) * A * f * m).sum() + (0.1 * D * active).sum()
        loss.backward()
        out[fused] = logp, ent, D, f, [p.grad.clone() for p in m64.parameters()]
    (lp1, e1, D1, f1, g1), (lp0, e0, D0, f0, g0) = out[True], out[False]
    assert D0[1:].mean() > 1e-3 and (D1[0] == 0).all() and 0 < f0[1:].max() < 1 and D1.requires_grad == kl_grad
    assert torch.allclose(lp1, lp0, rtol=1e-5, atol=1e-7)
    assert torch.allclose(e1, e0, atol=5e-5)  # a diagnostic: lse - sum p z in fp32 on both paths (cancellation)
    assert torch.allclose(D1, D0, rtol=1e-5, atol=1e-7) and torch.allclose(f1, f0, rtol=1e-5, atol=1e-7)
    scale = max(g.abs().max() for g in g0)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6 * scale) for a, b in zip(g1, g0))
    m64.zero_grad()


@pytest.mark.parametrize("fused", [True, False])
def test_f_carries_no_gradient(tiny, fused):
    """With teachers present, D and f are constants of the loss: the parameter gradients of -sum(f * logp) equal,
    bit for bit, those of the same loss with f's values copied in and no teacher pass at all."""
    model, tok = tiny
    comps = ["12+3=15\n15-4=11\n#### 11", "12+3=16", "12+3=15\n15-4=1"]
    _, ids, attn, T = _batch(tok, comps, ["Solve: 12+3-4\n"])
    problem = tasks.parse_arith_problem("12+3-4")
    teach = [None] + [tasks.encode_prompt(tok, reference_prompt(problem, comps[0]))] * 2
    m = attn[:, -T:].float()
    model.zero_grad()
    logp, _, D, _ = logprobs_and_kl(model, ids, attn, T, 1.0, teach, tok.pad_token_id, fused=fused)
    f = sc_grpo.kl_weights(D, m * torch.tensor([0.0, 1, 1])[:, None])
    assert not D.requires_grad and not f.requires_grad and f[1:].sum() > 0
    (-(f * logp * m).sum()).backward()
    with_teacher = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logp2, _, D2, _ = logprobs_and_kl(model, ids, attn, T, 1.0, None, tok.pad_token_id, fused=fused)
    (-(f.clone() * logp2 * m).sum()).backward()
    assert (D2 == 0).all() and torch.equal(logp.detach(), logp2.detach())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), with_teacher))
    model.zero_grad()


def test_c_is_the_micro_batch_percentile_unless_the_scope_is_the_batch():
    """--micro-batch-size enters the algorithm: D = {0.01, 0.01 | 1, 1} over two groups of 2 (one weighted token a row)
    gives c = P75 = 1 when both groups share a micro-batch, but c = 0.01 and c = 1 one group per micro-batch."""
    D, gid = torch.tensor([[0.01], [0.01], [1.0], [1.0]]), torch.tensor([0, 0, 1, 1])
    role, active, adv, rows = torch.full((4,), Role.WEIGHTED), torch.ones(4, 1), torch.zeros(4, 1), torch.arange(4)

    def weights(micro_batch_size):
        w = torch.empty(4, 1)
        for mb in sc_grpo.micro_batches_of_groups(rows, gid, 2, micro_batch_size):
            w[mb] = sc_grpo.weights_and_advantages(D[mb], active[mb], role[mb], gid[mb], adv[mb])[0]
        return w.flatten()

    shared = torch.tensor([0.01 / 1.01, 0.01 / 1.01, 0.5, 0.5])  # (0.0099, 0.0099, 0.5, 0.5)
    assert torch.allclose(weights(4), shared) and torch.allclose(weights(2), torch.full((4,), 0.5))
    batch = sc_grpo.weights_and_advantages(D, active, role, gid, adv)[0].flatten()  # --kl-threshold-scope batch
    assert torch.allclose(batch, shared)


def test_teacher_prompt_plain_and_chat(tiny):
    _, tok = tiny
    ex = tasks.Example(0, "12+3-4", "11", "Solve: 12+3-4\n", [], tasks.ARITH_INSTRUCTION + "12+3-4")
    got = sc_grpo.teacher_prompt(tok, "arith", ex, " 12+3=15\n#### 15\n")
    assert got == tok("Reference solution:\n12+3=15\n#### 15\nSolve: 12+3-4\n").input_ids  # the trained format
    chat = copy.deepcopy(tok)
    chat.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    student = tasks.render_prompt(chat, tasks.ARITH_INSTRUCTION + ex.question, ex.prompt)
    teacher_ids = sc_grpo.teacher_prompt(chat, "arith", ex, "12+3=15")
    want = "<system>" + sc_grpo.GUIDE + "12+3=15\n" + student  # tau in the system message, the user turn unchanged
    assert teacher_ids == tasks.encode_prompt(chat, want)
    with pytest.raises(ValueError, match="user turn"):  # an example without its user turn cannot be rebuilt
        sc_grpo.teacher_prompt(chat, "arith", dataclasses.replace(ex, user=""), "12+3=15")


def _rollouts(tok, texts, group_size):
    comps = [tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id] for t in texts]
    T = max(map(len, comps))
    mask = torch.tensor([[1] * len(c) + [0] * (T - len(c)) for c in comps])
    gids = torch.arange(len(texts)) // group_size
    ids = torch.tensor([c + [tok.pad_token_id] * (T - len(c)) for c in comps])
    return common.Rollouts(None, None, ids, mask, torch.zeros(len(texts), dtype=torch.bool), gids, list(texts))


def _teacher_of(tok, example):
    """build_teachers' make_prompt(i, tau) for rows that all share one example (the script's, per group)."""
    return lambda i, tau: sc_grpo.teacher_prompt(tok, "arith", example, tau)


def _plain(ro):
    """build_teachers' plain inputs from a Rollouts: the texts, the completion mask, the group ids."""
    return ro.texts, ro.completion_mask, ro.group_ids


def test_build_teachers_roles_resampling_truncation_and_no_reference(tiny):
    _, tok = tiny
    ex = tasks.Example(0, "12+3-4", "11", "Solve: 12+3-4\n", [])
    short, long_ = "12+3=15\n15-4=11\n#### 11", "12+3=15\n" * 6 + "15-4=11\n#### 11"
    texts = [short, long_, "oops", ""]  # n_c = 2 (rows 0, 1); row 3 is an empty completion
    ro = _rollouts(tok, texts, 4)
    correct = torch.tensor([True, True, False, False])
    room = len(sc_grpo.teacher_prompt(tok, "arith", ex, short))  # the short reference fits, the long one does not
    ref = torch.tensor([1, 0, 1, 1])  # as if every row drew the long reference (row 1 cannot draw itself)
    prompts, role, wlen, counts = sc_grpo.build_teachers(
        tok, _teacher_of(tok, ex), *_plain(ro), correct, ref, room, 8192, torch.Generator()
    )
    assert prompts[2] == prompts[3] == sc_grpo.teacher_prompt(tok, "arith", ex, short)  # resampled to the short one
    assert prompts[1] == prompts[2]  # row 1 drew row 0, which fits
    assert tok.decode(prompts[0]).count("...") == 1 and len(prompts[0]) <= room  # no other correct one: middle cut
    assert counts == {"sc/tau_resampled": 2, "sc/tau_truncated": 1, "sc/no_reference": 0}
    assert role.tolist() == [Role.WEIGHTED] * 4 and torch.equal(wlen, ro.completion_mask.sum(1))
    # solve-none: o_r (row 0) is the REFERENCE; the others are weighted up to min(|o_i|, |o_r|); no room at all: counted
    ro = _rollouts(tok, ["ab", "abcdef", "", "x"], 4)
    wrong = torch.zeros(4, dtype=torch.bool)
    prompts, role, wlen, counts = sc_grpo.build_teachers(
        tok, _teacher_of(tok, ex), *_plain(ro), wrong, torch.tensor([-1, 0, 0, 0]), 10**6, 8192, torch.Generator()
    )
    assert (
        role.tolist() == [Role.REFERENCE] + [Role.DIVERSITY] * 3
        and wlen.tolist() == [3, 3, 1, 2]
        and prompts[0] is None
    )
    prompts, role, _, counts = sc_grpo.build_teachers(
        tok, _teacher_of(tok, ex), *_plain(ro), wrong, torch.tensor([-1, 0, 0, 0]), 5, 8192, torch.Generator()
    )
    assert (
        prompts == [None] * 4
        and role.tolist() == [Role.REFERENCE] + [Role.PLAIN] * 3
        and counts["sc/no_reference"] == 3
    )


def test_build_teachers_takes_plain_inputs_and_asks_make_prompt_for_each_row_and_its_taus(tiny):
    """build_teachers calls make_prompt(i, tau) for the row i being taught with its reference texts (a tau that does
    not fit is swapped for a correct sibling drawn from `generator`) and returns Teachers by name: two groups with
    their own examples, wlen from the mask (not the texts), the same draws for the same generator state."""
    _, tok = tiny
    exs = [tasks.Example(g, q, "0", f"Solve: {q}\n", []) for g, q in enumerate(["1+2", "7-3"])]
    texts = ["a1", "a22", "bad", "a333", "b1", "b22", "bad", "b333"]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]] * 2)
    gid, correct = torch.tensor([0] * 4 + [1] * 4), torch.tensor([True, True, False, True] * 2)
    tau_row = torch.tensor([1, 0, 3, 0, 5, 4, 7, 4])  # rows 2 and 6 drew a tau too long to fit
    asked = []

    def make(i, tau):
        asked.append((i, tau))
        return sc_grpo.teacher_prompt(tok, "arith", exs[int(gid[i])], tau)

    fits = len(make(0, "a22"))  # room for a 3-character reference, not for "a333" / "b333"
    asked.clear()
    out = sc_grpo.build_teachers(tok, make, texts, mask, gid, correct, tau_row, fits, 8192, torch.Generator())
    assert isinstance(out, sc_grpo.Teachers) and out.role.tolist() == [Role.WEIGHTED] * 8
    assert out.bad == {"sc/tau_resampled": 2, "sc/tau_truncated": 0, "sc/no_reference": 0}
    for i, p in enumerate(out.prompts):  # the row's own example; tau a correct sibling's text, never its own
        _, tau, *rest = tok.decode(p).split("\n")
        g = int(gid[i])
        assert exs[g].prompt.strip() in rest and tau != texts[i] and tau in texts[4 * g : 4 * g + 4] and tau != "bad"
    assert [i for i, _ in asked if i in (2, 6)] == [2, 2, 6, 6]  # the drawn tau, then the resampled one
    assert {i for i, _ in asked} == {0, 1, 2, 3, 4, 5, 6, 7} and out.wlen.tolist() == mask.sum(1).tolist()
    again = sc_grpo.build_teachers(tok, make, texts, mask, gid, correct, tau_row, fits, 8192, torch.Generator())
    assert again.prompts == out.prompts and again.bad == out.bad


# --- the script ----------------------------------------------------------------------------------
def _run_capturing_grads(monkeypatch, tmp_path, script, *flags):
    """Run a script one step in-process with a reward that mixes groups; return its metrics and its gradients."""
    grads = []

    def load_task(*a, **k):
        task = REAL_LOAD_TASK(*a, **k)
        calls = itertools.count()  # alternating by call order: every group of 4 is mixed, whatever the model writes
        task.reward_fn = lambda completion, ex: float(next(calls) % 2)
        return task

    def clip(params, max_norm, *a, **k):
        params = list(params)
        grads.append([p.grad.clone() for p in params])
        return REAL_CLIP(params, max_norm, *a, **k)

    monkeypatch.setattr(tasks, "load_task", load_task)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    out = tmp_path / f"{script}-{len(list(tmp_path.iterdir()))}"
    run_inprocess(
        script,
        "--total-steps",
        "1",
        "--output-dir",
        str(out),
        "--num-eval",
        "2",
        "--eval-every",
        "0",
        "--prompts-per-step",
        "4",
        "--num-generations",
        "4",
        "--max-new-tokens",
        "32",
        "--micro-batch-size",
        "8",
        *flags,
    )
    return read_metrics(out)[1], grads[0]


@pytest.mark.slow
def test_weight_mode_none_equals_grpo_loss_and_gradient(tmp_path, monkeypatch):
    mb = ("--micro-batch-size", "6")  # not a multiple of G: grpo.py's micro-batches, not whole groups
    base, g_base = _run_capturing_grads(monkeypatch, tmp_path, "grpo.py", *mb)
    none, g_none = _run_capturing_grads(
        monkeypatch, tmp_path, "sc_grpo.py", "--weight-mode", "none", "--outcome-std", "unbiased", *mb
    )
    assert base["frac_reward_zero_std"] < 1 and base["grad_norm"] > 0  # a real gradient, not 0 == 0
    assert none["policy_loss"] == base["policy_loss"] and none["grad_norm"] == base["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(g_none, g_base))
    sc, g_sc = _run_capturing_grads(monkeypatch, tmp_path, "sc_grpo.py")  # the method does change the gradient
    assert sc["sc/groups_partial"] + sc["sc/groups_none"] > 0 and 0 < sc["sc/weight_mean"] < 1
    assert sc["sc/kl_p95"] >= sc["sc/kl_p75"] > 0 and sc["time/teacher"] > 0
    assert not all(torch.equal(a, b) for a, b in zip(g_sc, g_base))


@pytest.mark.slow
def test_additive_kl_baseline_and_ablation_flags_run(tmp_path, monkeypatch):
    m, _ = _run_capturing_grads(
        monkeypatch,
        tmp_path,
        "sc_grpo.py",
        "--weight-mode",
        "none",
        "--kl-loss-coef",
        "0.1",
        "--weighted-groups",
        "partial",
        "single",
        "all",
        "none",
        "--num-iterations",
        "2",
        "--max-reference-tokens",
        "12",
    )
    assert all(v == v for v in m.values()) and m["sc/kl_mean"] > 0 and m["sc/weight_mean"] == 0  # D, but no f
    assert m["sc/groups_plain"] < 1 and m["sc/tau_truncated"] + m["sc/no_reference"] > 0


@pytest.mark.slow
def test_batch_scope_gives_one_c_whatever_the_micro_batch_size(tmp_path, monkeypatch):
    """Four partial-solve groups of 4: with --kl-threshold-scope batch and one group per micro-batch, f (and so the
    gradient) is that of the micro-batch scope with all four groups in one micro-batch, not that of one group per
    micro-batch."""
    one, g_one = _run_capturing_grads(monkeypatch, tmp_path, "sc_grpo.py", "--micro-batch-size", "16")
    per, _ = _run_capturing_grads(monkeypatch, tmp_path, "sc_grpo.py", "--micro-batch-size", "4")
    batch, g_batch = _run_capturing_grads(
        monkeypatch, tmp_path, "sc_grpo.py", "--micro-batch-size", "4", "--kl-threshold-scope", "batch"
    )
    assert one["sc/groups_partial"] == 1 and one["sc/weight_mean"] != pytest.approx(per["sc/weight_mean"], rel=1e-3)
    for key in ("sc/weight_mean", "sc/kl_p75", "sc/kl_mean", "grad_norm", "policy_loss"):
        assert batch[key] == pytest.approx(one[key], rel=1e-4, abs=1e-9), key
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-7) for a, b in zip(g_batch, g_one))


@pytest.mark.slow
def test_the_fused_update_learns_as_the_unfused_one(tmp_path, monkeypatch):
    """sc_grpo.py at its defaults, 3 steps of the built-in task on the tiny model: the memory-bounded path (hidden
    states through the fused kernels) and the [b, T, V] logits path (forced everywhere) log the same metrics to float
    error, so the fused update changed nothing SC-GRPO learns."""
    from rlvr_utils.core import logprob_kernels

    flags = (
        "--total-steps",
        "3",
        "--num-eval",
        "8",
        "--eval-every",
        "3",
        "--prompts-per-step",
        "4",
        "--num-generations",
        "4",
        "--max-new-tokens",
        "32",
    )
    run_inprocess("sc_grpo.py", "--output-dir", str(tmp_path / "fused"), *flags)
    asked = []
    monkeypatch.setattr(logprob_kernels, "fused_logprobs_ok", lambda model: asked.append(1) and False)
    run_inprocess("sc_grpo.py", "--output-dir", str(tmp_path / "unfused"), *flags)
    assert asked  # the update really took the unfused path
    fused, unfused = read_metrics(tmp_path / "fused"), read_metrics(tmp_path / "unfused")
    assert len(fused) == len(unfused) == 4 and any(r.get("sc/weight_mean", 0) > 0 for r in fused)
    for a, b in zip(fused, unfused):
        for key in a:
            if key.startswith(("time/", "tokens_per_second", "memory/")) or key not in b:
                continue
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)


def test_sampled_logratio_refuses_the_additive_kl_term(capsys):
    with pytest.raises(SystemExit) as e:
        run_inprocess("sc_grpo.py", "--divergence", "sampled-logratio", "--kl-loss-coef", "0.1")
    assert e.value.code == 2 and "--kl-loss-coef needs --divergence kl" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [("--c-min", "0"), ("--percentile", "101"), ("--max-reference-tokens", "0")])
def test_bad_flags_are_a_clear_error(flag, capsys):
    with pytest.raises(SystemExit) as e:
        run_inprocess("sc_grpo.py", *flag)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {flag[0]} must be") and f"got {flag[1]}" in err


@pytest.mark.slow
def test_sc_grpo_two_steps_subprocess(tmp_path):
    out = run_script(
        "sc_grpo.py",
        "--total-steps",
        "2",
        "--output-dir",
        str(tmp_path),
        "--num-eval",
        "16",
        "--eval-every",
        "0",
        "--prompts-per-step",
        "4",
        "--num-generations",
        "4",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in NEW_METRICS + ("reward", "policy_loss", "grad_norm", "entropy"):
        assert key in rows[1] and key in rows[2], key
    for r in rows[1:]:
        assert all(v == v for v in r.values())  # no NaN
        assert 0 <= r["sc/weight_mean"] < 1 and r["sc/kl_mean"] >= 0
        assert abs(sum(r[f"sc/groups_{k}"] for k in ("partial", "none", "single", "all", "plain")) - 1) < 1e-6


TEMPLATE_WITH_DEFAULT = (  # a Qwen2.5-like chat template that adds a system message when the conversation has none
    "{% if messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>system\nYou are a careful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATE_WITHOUT_DEFAULT = TEMPLATE_WITH_DEFAULT.replace(
    "{% else %}<|im_start|>system\nYou are a careful assistant.<|im_end|>\n", "{% else %}"
)


def test_teacher_keeps_the_students_default_system_message(tiny):
    """Paper §1.2: the teacher is the student's full context plus the guide and tau. With a template that adds a
    default system message, the teacher's system message is that default + guide + tau, so the student's and the
    teacher's prompts differ by exactly the inserted guide and reference."""
    _, tok = tiny
    tok = copy.deepcopy(tok)
    tok.chat_template = TEMPLATE_WITH_DEFAULT
    assert teacher.default_system_message(tok) == "You are a careful assistant."
    user = "What is 1+1?"
    ex = tasks.Example(0, user, "2", tasks.render_prompt(tok, user, user), [], user)
    student = ex.prompt
    teacher_text = tok.decode(sc_grpo.teacher_prompt(tok, "gsm8k", ex, " 1+1=2, so \\boxed{2} "))
    inserted = "\n\n" + sc_grpo.GUIDE + "1+1=2, so \\boxed{2}"
    head = "<|im_start|>system\nYou are a careful assistant."
    assert student.startswith(head) and teacher_text == student.replace(head, head + inserted, 1)
    tok.chat_template = TEMPLATE_WITHOUT_DEFAULT
    assert teacher.default_system_message(tok) == ""
    ex = tasks.Example(0, user, "2", tasks.render_prompt(tok, user, user), [], user)
    assert tok.decode(sc_grpo.teacher_prompt(tok, "gsm8k", ex, "tau")).startswith(
        "<|im_start|>system\n" + sc_grpo.GUIDE + "tau<|im_end|>"
    )


def test_graded_group_without_a_full_solve_keeps_its_grpo_advantages():
    """Code task, partial credit: a group with no full solve but different scores is plain GRPO (its advantages carry
    the partial credit); only a group whose scores are all equal gets the solve-none treatment."""
    scores = torch.tensor([0.5, 0.25, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0])
    modes, ref = sc_grpo.route_groups(scores >= 1.0, 4, torch.Generator().manual_seed(0), scores=scores)
    assert modes == ["plain", "none", "partial"]
    assert (ref[:4] == -1).all() and (ref[4:8] >= 0).sum() == 3 and (ref[8:] >= 0).all()
    modes, _ = sc_grpo.route_groups(scores >= 1.0, 4, torch.Generator().manual_seed(0))  # binary view: both "none"
    assert modes[:2] == ["none", "none"]


# --- unscored rollouts (a reward of None: NaN) ---------------------------------------------------
NAN = float("nan")


def test_an_unscored_rollout_is_neither_success_nor_failure_in_the_routing():
    """[1, None, 1, 1] is routed by its three scored rollouts (all correct: plain, not partial); [1, None, 1, 0] is
    partial with n_c = 2 of 3; in [0, None, 0, 0] (solve-none) the unscored rollout is never drawn as o_r; an all-None
    group is plain, not solve-none (sc/groups_none). The unscored one never gets a teacher (tau -1)."""
    rows = [[1, NAN, 1, 1], [1, NAN, 1, 0], [0, NAN, 0, 0], [NAN] * 4]
    scores = torch.tensor(rows).flatten()
    correct = scores >= 1.0
    drawn = set()
    for seed in range(60):
        modes, tau = sc_grpo.route_groups(correct, 4, torch.Generator().manual_seed(seed), scores=scores)
        assert modes == ["plain", "partial", "none", "plain"]
        assert tau[[1, 5, 9, 13]].tolist() == [-1] * 4 and (tau[:4] == -1).all() and (tau[12:] == -1).all()
        assert all(int(tau[i]) in (4, 6) for i in (4, 6, 7)) and tau[4] != 4 and tau[6] != 6
        r = [i for i in (8, 10, 11) if tau[i] == -1]  # o_r: one of the scored rollouts
        assert len(r) == 1 and all(tau[i] == r[0] for i in (8, 10, 11) if i != r[0])
        drawn.add(r[0])
    assert drawn == {8, 10, 11}  # each scored rollout is o_r sometimes, the unscored one never
    all_ = sc_grpo.route_groups(correct, 4, torch.Generator().manual_seed(0), weighted=("all",), scores=scores)
    assert all_[0][0] == "all" and all_[1][1] == -1 and all(int(all_[1][i]) in (0, 2, 3) for i in (0, 2, 3))


def test_an_unscored_rollout_gets_no_role_and_advantage_zero_in_a_solve_none_group(tiny):
    """The credit of [0, None, 0, 0] end to end (routing, teachers, f and the bonus): the unscored rollout is PLAIN
    with advantage 0 exactly (given a role it got alpha * zscore, -0.068 here), its siblings share the bonus."""
    _, tok = tiny
    ex = tasks.Example(0, "12+3-4", "11", "Solve: 12+3-4\n", [])
    ro = _rollouts(tok, ["12+3=15", "1+1=3\n1", "15-4=11", "9"], 4)
    scores = torch.tensor([0.0, NAN, 0.0, 0.0])
    correct, gid = scores >= 1.0, ro.group_ids
    for seed in range(8):
        _, tau = sc_grpo.route_groups(correct, 4, torch.Generator().manual_seed(seed), gid, scores=scores)
        _, role, wlen, _ = sc_grpo.build_teachers(
            tok, _teacher_of(tok, ex), *_plain(ro), correct, tau, 10**6, 8192, torch.Generator()
        )
        assert role[1] == Role.PLAIN and sorted(role.tolist()) == [Role.PLAIN, Role.DIVERSITY, Role.DIVERSITY, 3]
        active = sc_grpo.weighted_tokens(ro.completion_mask, role, wlen)
        D = torch.rand(ro.completion_mask.shape, generator=torch.Generator().manual_seed(seed)) + 0.1
        adv = common.group_advantages(scores, 4)[:, None].expand_as(D).clone()  # 0 for every row
        _, adv, _ = sc_grpo.weights_and_advantages(D, active, role, gid, adv)
        assert (adv[1] == 0).all() and (adv[role == Role.DIVERSITY].abs() > 0).all()


def test_the_additive_kl_term_acts_whatever_the_weight_mode(tmp_path, monkeypatch):
    """--kl-loss-coef: D, with its gradient, joins the loss in every pass, also where f is not made (--weight-mode
    none): the teacher runs for it (`if f_here or kl_grad`), so the gradient differs from the run without. In the fast
    set: two one-step runs in-process (~8 s on a loaded 2-core machine), the rule's only pin."""
    plain, g_plain = _run_capturing_grads(monkeypatch, tmp_path, "sc_grpo.py", "--weight-mode", "none")
    kl, g_kl = _run_capturing_grads(
        monkeypatch, tmp_path, "sc_grpo.py", "--weight-mode", "none", "--kl-loss-coef", "0.5"
    )
    assert plain["sc/kl_mean"] == 0 and kl["sc/kl_mean"] > 0 and kl["sc/weight_mean"] == 0  # D made, f not
    assert not all(torch.equal(a, b) for a, b in zip(g_kl, g_plain))
