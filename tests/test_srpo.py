"""srpo.py, its chain protocol and its generate calls (rlvr_utils/methods/chains.py): thought splitting, localization
parsing, reset indices, suffix masking through the real training step, the oracle, the fallback path, and subprocess
runs of each reset mode."""

import collections
import random
import re
import types

import pytest
import torch
from helpers import read_metrics, run_inprocess, run_script

import common
import srpo
from rlvr_utils.core import rollouts, runtime, tasks

FAST = ["--num-eval", "16", "--eval-every", "0", "--prompts-per-step", "3"]


@pytest.mark.parametrize(
    "text,delim,expected",
    [
        ("23+7=30\n30-5=25\n#### 25", "\n", ["23+7=30", "30-5=25", "#### 25"]),
        ("\n\n a \n\nb\n", "\n", ["a", "b"]),
        ("", "\n", []),
        ("one step only", "\n", ["one step only"]),
        (
            "First.\n\nSecond line\nstill second.\n\n\\boxed{3}",
            "\n\n",
            ["First.", "Second line\nstill second.", "\\boxed{3}"],
        ),
        ("a</thought>b</thought>", "</thought>", ["a", "b"]),
    ],
)
def test_split_thoughts(text, delim, expected):
    assert srpo.split_thoughts(text, delim) == expected
    starts = srpo.thought_starts(text, delim)
    assert [text[s : s + len(t)] for s, t in zip(starts, expected)] == expected


@pytest.mark.parametrize(
    "reply,n,expected,kind",
    [
        ("\\boxed{2}", 4, 2, "ok"),
        ("Step 1 looks fine. Step 3 is wrong.\n\\boxed{3}", 4, 3, "ok"),
        ("\\boxed{1} no wait \\boxed{4}", 4, 4, "ok"),
        ("\\boxed{0}", 4, 1, "no_error"),
        ("\\boxed{9}", 4, 1, "out_of_range"),
        ("\\boxed{9} but really Step 2", 4, 2, "out_of_range"),
        ("the error is in Step 3, maybe step 2", 4, 2, "unparsable"),
        ("Step 7", 4, 1, "unparsable"),
        ("\\boxed{two}", 4, 1, "unparsable"),
        ("\\boxed{2", 4, 1, "unparsable"),
        ("", 4, 1, "empty"),
        ("   ", 3, 1, "empty"),
        ("\\boxed{1}", 1, 1, "ok"),
    ],
)
def test_parse_error_step(reply, n, expected, kind):
    assert srpo.parse_reply(reply, n) == (expected, kind)


def test_parse_error_step_rejects_empty_parent():
    with pytest.raises(ValueError):
        srpo.parse_reply("\\boxed{1}", 0)


def test_reset_index_modes():
    rng = random.Random(0)
    draws = [srpo.reset_index("random", 5, rng) for _ in range(2000)]
    assert set(draws) == {1, 2, 3, 4, 5} and abs(sum(draws) / len(draws) - 3) < 0.1
    assert srpo.reset_index("oracle", 5, oracle_step=3) == 3
    assert srpo.reset_index("oracle", 5, oracle_step=None) == 5  # no wrong thought found: the last one
    assert srpo.reset_index("oracle", 5, oracle_step=6) == 5  # a missing thought: clamped
    assert srpo.reset_index("self", 5, reply="\\boxed{4}") == 4
    with pytest.raises(ValueError):
        srpo.reset_index("best", 5)


def test_oracle_picks_true_first_error_on_arith():
    rng = random.Random(3)
    for _ in range(200):
        p = tasks.make_arith_problem(rng)
        lines = p.solution().split("\n")
        k = rng.randint(1, len(lines))
        lines[k - 1] = lines[k - 1] + "1"  # corrupt line k
        parent = "\n".join(lines)
        th = srpo.split_thoughts(parent, "\n")
        assert srpo.reset_index("oracle", len(th), oracle_step=tasks.arith_first_error(p, parent)) == k


def test_suffix_mask():
    cm = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    got = srpo.suffix_mask(cm, torch.tensor([2, 0, 4]))
    assert got.tolist() == [[0, 0, 1, 1, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 1]]


def test_prefix_token_count_cuts_before_thought_k(tiny):
    """A parent whose first wrong line is k (the oracle's reset point) keeps its first k - 1 lines as sampled tokens."""
    _, tok = tiny
    sampler = types.SimpleNamespace(tokenizer=tok, info=collections.Counter())
    lines = ["23+7=30", "30-5=25", "25+9=34", "#### 34"]
    prompt = "Solve: 23+7-5+9\n"
    ex = tasks.Example(0, "23+7-5+9", "34", prompt, tok(prompt).input_ids)
    task = types.SimpleNamespace(name="arith")
    for k in (1, 2, 3, 4):
        wrong = lines[: k - 1] + [lines[k - 1] + "1"] + lines[k:]  # line k corrupted
        text = "\n".join(wrong)
        ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
        search = {0: srpo.Search(parents=[srpo.Chain(ids, text, 0.0)])}
        args = _args(reset="oracle")
        (cut,) = srpo.reset_points(sampler, task, search, [ex], args, random.Random(0), 10**9)
        assert tok.decode(cut.prefix) == "".join(line + "\n" for line in lines[: k - 1]) and cut.k == k == cut.oracle


def _args(**kw):
    return srpo.Args(**{"max_new_tokens": 48, "thought_delimiter": "\n", **kw})


def _task(tok, n=3):
    task = tasks.load_task("arith", tok, seed=5, num_eval=4, arith_num_train=200)
    return task, task.train[:n]


@pytest.mark.slow
def test_collect_rollouts_oracle_batch(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    task, examples = _task(tok, 4)
    out = srpo.collect_rollouts(
        model, tok, task, iter([examples]), runtime.Dist(), _args(reset="oracle"), random.Random(0)
    )
    assert isinstance(out, srpo.ResetRollouts)  # the step's rows by name, from settle to the loss
    ro, suffix_start, info = out.rollouts, out.suffix_start, out.info
    assert len(ro) == 8 * len(examples)  # the budget: 8 trained trajectories per prompt
    prompts = [tuple(ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist()) for i in range(len(ro))]
    assert all(prompts.count(tuple(e.prompt_ids)) == 8 for e in examples)
    if info["num_parents"]:
        assert info["oracle_exact"] == 1.0 and info["oracle_after"] == 0.0
        # the reset rows start with their parent's correct prefix: every prefix line checks out
        for i in range(len(ro)):
            s = int(suffix_start[i])
            if s:
                prefix = tok.decode(ro.completion_ids[i, :s].tolist())
                e = next(
                    x
                    for x in examples
                    if tasks.arith_first_error(x.question, prefix) == len(srpo.split_thoughts(prefix, "\n")) + 1
                )
                assert e is not None
    groups = torch.unique(ro.group_ids, return_counts=True)[1]
    assert set(groups.tolist()) <= {4, 8}


@pytest.mark.slow
def test_collect_rollouts_fallback_when_nothing_fails(tiny):
    model, tok = tiny
    task, examples = _task(tok, 2)
    task.reward_fn = lambda completion, ex: 1.0
    out = srpo.collect_rollouts(
        model, tok, task, iter([examples]), runtime.Dist(), _args(max_fresh_attempts=6), random.Random(0)
    )
    ro, suffix_start, prompt_of_row, info = out.rollouts, out.suffix_start, out.prompt_of_row, out.info
    assert info["num_parents"] == 0 and info["fallback_share"] == 1.0
    assert info["fresh_chains"] == 6 * 2  # searched up to max_fresh_attempts, then topped up to 8 below
    assert len(ro) == 16 and (suffix_start == 0).all()
    assert torch.unique(ro.group_ids, return_counts=True)[1].tolist() == [8, 8]  # one GRPO group of 8 per prompt
    assert sorted(prompt_of_row.tolist()) == sorted([e.id for e in examples] * 8)


@pytest.mark.slow
def test_easy_prompt_fallback_samples_fresh_chains_official(tiny):
    """No failure among the searched chains: the official 1x4 fallback keeps the 4 base chains and samples 4 fresh
    ones (it used to reuse searched chains, all correct by construction, so the group could never give a signal).
    Here the searched chains are all right and every fresh one is wrong: the group has a signal."""
    model, tok = tiny
    task, examples = _task(tok, 2)
    calls = {}

    def reward(completion, ex):
        calls[ex.id] = calls.get(ex.id, 0) + 1
        return 1.0 if calls[ex.id] <= 6 else 0.0  # 6 = max_fresh_attempts: the search, then the top-ups

    task.reward_fn = reward
    out = srpo.collect_rollouts(
        model, tok, task, iter([examples]), runtime.Dist(), _args(max_fresh_attempts=6), random.Random(0)
    )
    rewards, prompt_of_row, info = out.rewards, out.prompt_of_row, out.info
    assert info["num_parents"] == 0 and info["fresh_chains"] == 12 and all(n == 6 + 4 for n in calls.values())
    for e in examples:
        r = rewards[prompt_of_row == e.id]
        assert sorted(r.tolist()) == [0.0] * 4 + [1.0] * 4  # 4 kept base chains (right) + 4 fresh ones (wrong)


@pytest.mark.slow
def test_parent_never_enters_the_batch(tiny):
    """Only the first fresh chain of each prompt fails (by construction of the reward): it becomes
    the parent, and no trajectory of the trained batch may carry its 0 reward."""
    model, tok = tiny
    task, examples = _task(tok, 2)
    seen = {}

    def reward(completion, ex):
        seen[ex.id] = seen.get(ex.id, 0) + 1
        return 0.0 if seen[ex.id] == 1 else 1.0

    task.reward_fn = reward
    out = srpo.collect_rollouts(
        model, tok, task, iter([examples]), runtime.Dist(), _args(reset="random"), random.Random(0)
    )
    ro, rewards, info = out.rollouts, out.rewards, out.info
    assert info["num_parents"] == 2
    assert len(ro) == 16 and (rewards == 1.0).all()


@pytest.mark.slow
def test_prefix_gets_zero_gradient_and_advantages_scale_it(tmp_path, monkeypatch):
    """Through the real training step: capture the log-probs, advantages and loss mask srpo.py uses,
    and check d loss / d logp = -A_i / (N |U_i|) on suffix tokens and exactly 0 on prefix tokens."""
    captured = {}
    real_lp, real_adv, real_agg = common.token_logprobs, common.group_advantages, common.aggregate_loss

    def lp(*a, **k):
        out = real_lp(*a, **k)
        if k.get("with_entropy") and out[0].requires_grad:
            out[0].retain_grad()
            captured["logp"] = out[0]
        return out

    def adv(rewards, *a, **k):
        out = real_adv(rewards, *a, **k)
        captured["adv"], captured["rewards"], captured["gids"] = out, rewards, k["group_ids"]
        return out

    def agg(per_token, mask, *a, **k):
        captured["mask"] = mask
        return real_agg(per_token, mask, *a, **k)

    monkeypatch.setattr(common, "token_logprobs", lp)
    monkeypatch.setattr(common, "group_advantages", adv)
    monkeypatch.setattr(common, "aggregate_loss", agg)
    run_inprocess(
        "srpo.py",
        "--reset",
        "oracle",
        "--total-steps",
        "1",
        "--output-dir",
        str(tmp_path),
        "--micro-batch-size",
        "64",
        "--prompts-per-step",
        "4",
        "--num-eval",
        "8",
        "--eval-every",
        "0",
        "--seed",
        "3",
    )
    grad, A, m = captured["logp"].grad, captured["adv"], captured["mask"]
    N = m.shape[0]
    # advantages are the per-group population z-scores of the rewards, not ones
    r, g = captured["rewards"], captured["gids"]
    for gid in g.unique():
        rr = r[g == gid]
        expected = torch.zeros_like(rr) if rr.max() == rr.min() else (rr - rr.mean()) / rr.std(unbiased=False)
        assert torch.allclose(A[g == gid].cpu(), expected, atol=1e-5)
    assert not torch.all(A == 1)
    U = m.sum(1)
    expected = torch.where(m > 0, -A[:, None] / (N * U.clamp(min=1)[:, None]), torch.zeros_like(grad))
    assert torch.allclose(grad, expected, atol=1e-7)
    assert (grad[m == 0] == 0).all()
    rows = read_metrics(tmp_path)
    # some trained rows are continuations whose prefix is masked (valid tokens with mask 0 before the suffix)
    assert rows[1]["reset/num_parents"] > 0
    assert ((m[:, 0] == 0) & (U > 0)).any(), "no continuation with a masked prefix was trained"


@pytest.mark.slow
@pytest.mark.parametrize("reset", ["self", "random", "oracle"])
def test_srpo_runs_each_reset_mode(tmp_path, reset):
    out = run_script("srpo.py", "--reset", reset, "--total-steps", "2", "--output-dir", str(tmp_path), *FAST)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "reset/normalized_position",
        "reset/correction_rate",
        "reset/suffix_pass_at_k",
        "reset/fallback_share",
        "reset/generated_tokens",
        "time/localization",
        "reset/oracle_exact",
        "reset/oracle_within_1",
        "reset/oracle_after",
    ):
        assert key in rows[1], key
    assert rows[1]["reset/oracle_exact"] + rows[1]["reset/oracle_after"] <= 1.0 + 1e-9


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags", [["--split", "2x4", "--clip"], ["--split", "1x8", "--no-mask", "--loss-agg", "token-mean"]]
)
def test_srpo_ablation_flags_run(tmp_path, flags):
    run_inprocess("srpo.py", "--total-steps", "1", "--output-dir", str(tmp_path), *FAST, *flags)
    rows = read_metrics(tmp_path)
    assert rows[1]["reward"] == rows[1]["reward"]  # not NaN


def test_protocol_cut_ends_after_the_boxed_thought_and_at_twenty_thoughts(tiny):
    _, tok = tiny
    text = "First step.\n\nSo x = 4, \\boxed{4}.\n\nBut also 5.\n\nDone."
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(srpo.protocol_cut(tok, ids, text, "\n\n")) == "First step.\n\nSo x = 4, \\boxed{4}."
    long = "\n".join(f"{i}+1={i + 1}" for i in range(25))
    ids = tok(long, add_special_tokens=False).input_ids + [tok.eos_token_id]
    kept = tok.decode(srpo.protocol_cut(tok, ids, long, "\n"), skip_special_tokens=True)
    assert kept == "\n".join(f"{i}+1={i + 1}" for i in range(20))
    short = "1+1=2\n#### 2"  # nothing to cut: the ids come back unchanged (the stop token included)
    ids = tok(short, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert srpo.protocol_cut(tok, ids, short, "\n") == ids


def test_protocol_cut_keeps_whole_thoughts_within_the_token_budget(tiny):
    """The official budget rules (one token per character here): a thought starts only with `reserve` tokens of the
    budget left; a thought the budget or the generation cap cut short is dropped back to the last whole thought."""
    _, tok = tiny
    text = "12+3=15\n15-4=11\n11+2=13\n#### 13"  # thoughts start at tokens 0, 8, 16, 24; 31 tokens, then EOS
    ids = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]

    def kept(**kw):
        return tok.decode(srpo.protocol_cut(tok, ids, text, "\n", **kw), skip_special_tokens=True)

    assert srpo.protocol_cut(tok, ids, text, "\n", budget=40, reserve=0) == ids  # all of it fits: unchanged
    assert kept(budget=20, reserve=0) == "12+3=15\n15-4=11"  # the budget cuts thought 3 (16-23) short: dropped
    assert kept(budget=40, reserve=10) == text  # 40 - 24 = 16 >= 10 tokens left when thought 4 starts
    assert kept(budget=32, reserve=10) == "12+3=15\n15-4=11\n11+2=13"  # 32 - 24 = 8 < 10 left: no 4th thought
    assert kept(budget=33, reserve=8) == text  # 33 - 24 = 9 >= 8 left: it starts (and ends at the EOS)
    cut = ids[:20]  # the generation cap stopped it mid-thought (no EOS): the partial third line goes
    assert tok.decode(
        srpo.protocol_cut(tok, cut, text[:20], "\n", truncated=True, budget=48), skip_special_tokens=True
    ) == ("12+3=15\n15-4=11")
    assert srpo.protocol_cut(tok, ids[:5], text[:5], "\n", budget=3, reserve=0) == ids[:3]  # nothing whole fits
    # a continuation whose prefix left too little: nothing whole fits, so it adds nothing (the official loop's cut)
    assert srpo.protocol_cut(tok, ids[:5], text[:5], "\n", budget=3, reserve=0, continuation=True) == []
    assert srpo.protocol_cut(tok, ids, text, "\n", budget=4, reserve=5, continuation=True) == []  # no room to start


@pytest.mark.slow
def test_clip_ablation_clips_with_several_minibatch_steps(tmp_path):
    """--clip with --num-minibatches 4: after the first optimizer step the ratio leaves 1, so the clipped surrogate and
    its clip fractions are live (with one step per batch the ratio is exactly 1 and --clip changed nothing)."""
    run_inprocess(
        "srpo.py",
        "--total-steps",
        "2",
        "--output-dir",
        str(tmp_path),
        *FAST,
        "--prompts-per-step",
        "4",
        "--clip",
        "--num-minibatches",
        "4",
        "--loss-agg",
        "token-mean",
        "--learning-rate",
        "5e-4",
        "--epsilon",
        "0.02",
        "--seed",
        "2",
    )
    rows = read_metrics(tmp_path)
    assert max(r["clip_ratio/region_mean"] for r in rows[1:]) > 0


def test_continuation_counts_the_prefix_thoughts_in_the_twenty_thought_budget(tiny, monkeypatch):
    """Official protocol: a chain stops at 20 thoughts in all. Every sampled response here has 15 thoughts and the
    first chain of each prompt fails, so a random reset at thought k keeps k - 1 prefix thoughts; the continuation
    may add only 20 - (k - 1) thoughts (it used to add 15 whatever the prefix, up to 29 thoughts in one row)."""
    model, tok = tiny
    task, examples = _task(tok, 3)
    text = "\n".join(["1+1=2"] * 15)
    response = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]

    def fake_generate(model, tokenizer, prompts, group_ids, num_generations, max_new_tokens, *a, **k):
        ro = common.make_rollouts(tokenizer, prompts, [response] * len(prompts), group_ids, [tok.eos_token_id])
        ro.texts = [text] * len(prompts)
        return ro

    monkeypatch.setattr(rollouts, "generate_rollouts", fake_generate)  # chains.Sampler's generate calls
    seen = {}

    def reward(completion, ex):
        seen[ex.id] = seen.get(ex.id, 0) + 1
        return 0.0 if seen[ex.id] == 1 else 1.0

    task.reward_fn = reward
    out = srpo.collect_rollouts(
        model, tok, task, iter([examples]), runtime.Dist(), _args(reset="random", max_new_tokens=400), random.Random(3)
    )
    ro, suffix_start, info = out.rollouts, out.suffix_start, out.info
    assert info["num_parents"] == 3
    counts = []
    for i in range(len(ro)):
        ids = ro.completion_ids[i][ro.completion_mask[i].bool()].tolist()
        n = len(srpo.split_thoughts(tok.decode(ids, skip_special_tokens=True), "\n"))
        prefix = len(srpo.split_thoughts(tok.decode(ids[: int(suffix_start[i])], skip_special_tokens=True), "\n"))
        counts.append((prefix, n))
    assert all(n == min(20, prefix + 15) for prefix, n in counts), counts
    assert any(prefix > 5 for prefix, _ in counts)  # the case that used to overflow is exercised


def test_localization_cap_help_matches_the_code():
    import inspect

    doc = inspect.getsource(srpo).split("localization_max_new_tokens:")[1].split('"""')[1]
    code = inspect.getsource(srpo.reset_points)
    assert "default: 4096; arith: max(192, 20 x (operations + 2))" in " ".join(doc.split())
    assert "max(192, 20 * (args.arith_steps + 2)) if task.name" in code and "else 4096" in code


class CharTokenizer:
    """One token per character (the tokenizer protocol_cut's worked example assumes)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_protocol_cut_s_worked_example_holds():
    """Each line of protocol_cut's worked example (its docstring) is what the function returns: text, the flags, and
    the kept text; so the example a reader learns the rule from cannot go stale."""
    doc = srpo.protocol_cut.__doc__
    pattern = r'text "([^"]*)"(?:, budget (\d+))?(?:, reserve (\d+))?\s+-> "([^"]*)"(?: \([^)]*; a continuation: "")?'
    cases = re.findall(pattern, doc)
    assert len(cases) == 4, cases
    tok = CharTokenizer()
    for text, budget, reserve, want in cases:
        text, want = text.replace(r"\n", "\n"), want.replace(r"\n", "\n")  # the docstring's \n: a newline
        kw = {"budget": int(budget)} if budget else {}
        kw |= {"reserve": int(reserve)} if reserve else {}
        ids = [ord(c) for c in text]
        assert tok.decode(srpo.protocol_cut(tok, ids, text, "\n", **kw)) == want, (text, kw)
    assert srpo.protocol_cut(tok, [ord(c) for c in "abcdefgh"], "abcdefgh", "\n", budget=4, continuation=True) == []


@pytest.mark.slow
def test_base_and_reset_groups_are_normalized_apart(tmp_path, monkeypatch):
    """Issue #54: a prompt's base chains and its reset group are two normalization groups (official 1x4: each z-scored
    alone), through the real step: the rollouts settle builds carry a group per (prompt, base | reset), and step 3
    z-scores over exactly those groups. Normalizing a prompt's 8 rows together fails here (one group of 8), as does
    step 3 grouping by prompt."""
    seen = {}
    real_make, real_adv = common.make_rollouts, common.group_advantages

    def make(tok, prompts, completions, group_ids, *a, **k):
        seen["built"] = torch.tensor(list(group_ids))
        seen["prompts"] = [tuple(p) for p in prompts]
        return real_make(tok, prompts, completions, group_ids, *a, **k)

    def adv(rewards, *a, **k):
        seen["used"], seen["rewards"] = k["group_ids"].clone(), rewards.clone()
        return real_adv(rewards, *a, **k)

    monkeypatch.setattr(common, "make_rollouts", make)
    monkeypatch.setattr(common, "group_advantages", adv)
    flags = ["--reset", "oracle", "--total-steps", "1", "--output-dir", str(tmp_path), "--prompts-per-step", "4"]
    run_inprocess("srpo.py", *flags, "--num-eval", "4", "--eval-every", "0", "--seed", "3")
    built, used = seen["built"], seen["used"]
    assert torch.equal(built.cpu(), used.cpu())  # step 3 normalizes over the groups the rollouts were built with
    prompts = seen["prompts"]
    with_reset = 0
    for p in dict.fromkeys(prompts):
        rows = [i for i, q in enumerate(prompts) if q == p]
        groups = sorted(torch.unique(built[rows], return_counts=True)[1].tolist())
        assert groups in ([4, 4], [8]), groups  # 1x4: base + reset group, or the fallback group of 8
        with_reset += groups == [4, 4]
    assert with_reset > 0  # the oracle found parents on some prompts: their two groups were kept apart
    rows = read_metrics(tmp_path)
    assert rows[1]["reset/num_parents"] == with_reset
