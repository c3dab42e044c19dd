"""The five scripts' copies of the shared training loop stay the same where they are meant to be (the design's "a
change to the shared loop is made in every algorithm file"): every line of grpo.py's `__main__` block (code only,
comments dropped) appears, in order, in each other script's, except the lines listed below, each one a documented
difference of that method. A shared line edited in one script, or in grpo.py alone, fails here."""

import difflib
import io
import re
import shutil
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# grpo.py lines a method replaces (each by the start of the line), and why: the methods' docstrings list the same
REPLACED = {
    "sc_grpo.py": [
        ("args = cli.parse(Args)", "its own checks (validate)"),
        ("run.start(model, tokenizer, optimizer, task)", "its routing RNG is checkpointed"),
        ("ro, rewards, sampling = common.rollouts_with_rewards(", "DAPO's dynamic sampling keeps solve-none groups"),
        ("advantages = dist.over_global_batch(common.group_advantages,", "--outcome-std"),
        ("token_adv = advantages.to(run.device)[:, None].expand(-1, T)", "a copy: the solve-none bonus adds in place"),
        ("with torch.no_grad():", "FSDP: the teacher passes differ in number per rank (gathered)"),
        ("micro = rows.split(args.micro_batch_size)", "micro-batches of whole groups (c: a micro-batch's percentile)"),
        ("logp, entropy = common.token_logprobs(", "the same forward also gives D to each row's teacher"),
        ("train_model, input_ids[mb], attn[mb], T, args.temperature,", "(the same call)"),
        ("per_token_loss = -surrogate", "times the token weight f"),
        ("run.end_step(step, ro, rewards, stats, sampling)", "+ the sc/* metrics"),
    ],
    "grpo_lambda.py": [
        ("args = cli.parse(Args)", "its own checks (validate)"),
        ("log_ratio = torch.clamp(logp - old,", "the traced log-ratio (grpo_lambda_token_loss)"),
        ("ratio = torch.exp(log_ratio)", "the traced ratio"),
        ("surrogate = torch.min(ratio * A,", "grpo_lambda_token_loss"),
        ("per_token_loss = -surrogate", "grpo_lambda_token_loss"),
        ("run.end_step(step, ro, rewards, stats, sampling)", "+ the trace/* metrics"),
    ],
    "ep_grpo.py": [
        ("args = cli.parse(Args)", "its own checks (validate)"),
        ("ref_model = copy.deepcopy(model)", "delta needs the reference even at --beta 0"),
        ("run.start(model, tokenizer, optimizer, task)", "a moving anchor is checkpointed"),
        ("gid = ro.group_ids.cpu()", "ep_advantages takes the group ids on the rows' device"),
        ("advantages = dist.over_global_batch(common.group_advantages,", "per-token advantages (ep_advantages)"),
        ("token_adv = advantages.to(run.device)[:, None].expand(-1, T)", "(ep_advantages)"),
        ("on_policy = args.num_iterations == 1", "log pi_old is needed even on-policy"),
        ("old_logp = None if on_policy else", "(with the rollout entropy)"),
        ("run.end_step(step, ro, rewards, stats, sampling)", "+ the ep/* metrics"),
    ],
    "srpo.py": [
        ("args = cli.parse(Args)", "its own checks (validate)"),
        ("run.start(model, tokenizer, optimizer, task)", "the reset draws are checkpointed"),
        ("dist, G = run.dist, args.num_generations", "--num-generations is the budget --split divides"),
        ("ro, rewards, sampling = common.rollouts_with_rewards(", "rollouts with resets (collect_rollouts)"),
        ("gid = ro.group_ids.cpu()", "normalization groups (srpo_advantages)"),
        ("advantages = dist.over_global_batch(common.group_advantages,", "each group alone, population std, no eps"),
        ("with torch.no_grad():", "FSDP: ranks hold different numbers of rows (gathered)"),
        ("for rows in common.minibatches(ro.group_ids,", "mini-batches by prompt, not group"),
        ("micro = rows.split(args.micro_batch_size)", "FSDP: as many micro-batches on every rank (idle passes)"),
        ("for k, mb in enumerate(micro):", "(idle passes)"),
        ("dist.sync_grads(train_model, k == len(micro) - 1)", "(idle passes)"),
        ("surrogate = torch.min(ratio * A,", "REINFORCE; --clip: the dual-clipped surrogate"),
        ("run.end_step(step, ro, rewards, stats, sampling)", "+ the reset/* metrics"),
    ],
}


def main_block(name: str) -> list[str]:
    """The code lines of a script's `if __name__ == "__main__":` block, comments dropped, indentation kept."""
    src = (ROOT / name).read_text()
    body = src[src.index('if __name__ == "__main__":') :]
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    code = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(body).readline) if t.type not in skip}
    return [re.sub(r"\s+#[^\"']*$", "", line).rstrip() for i, line in enumerate(body.splitlines(), 1) if i in code]


def missing_in_order(base: list[str], other: list[str]) -> list[str]:
    """The lines of `base` that `other` does not hold in the same order (a greedy subsequence match)."""
    pos, out = 0, []
    for line in base:
        try:
            pos = other.index(line, pos) + 1
        except ValueError:
            out.append(line.strip())
    return out


def test_the_reader_drops_comments_and_keeps_code():
    lines = main_block("grpo.py")
    assert "    run.finish()" in lines and not any("#" in line and "ALGO LOGIC" in line for line in lines)
    assert missing_in_order(["a", "b", "c"], ["a", "x", "c", "b"]) == ["c"]  # order matters


@pytest.mark.parametrize("script", sorted(REPLACED))
def test_the_shared_loop_is_grpo_py_s_but_for_the_method_s_lines(script):
    got = missing_in_order(main_block("grpo.py"), main_block(script))
    want = [start for start, _ in REPLACED[script]]
    matched = [next((w for w in want if line.startswith(w)), None) for line in got]
    drifted = [line for line, w in zip(got, matched) if w is None]
    assert not drifted, f"{script}: shared lines of grpo.py's loop missing or out of order: {drifted}"
    assert matched == want, f"{script}: documented differences that are gone: {sorted(set(want) - set(matched))}"


def changed_lines(a: str, b: str) -> int:
    """Lines removed plus lines added between two files: what `diff a b | grep -c '^[<>]'` counts (difflib, where
    there is no diff, finds a diff a line or two shorter)."""
    if shutil.which("diff"):
        out = subprocess.run(["diff", a, b], cwd=ROOT, capture_output=True, text=True).stdout
        return sum(line[:1] in "<>" and line[:1] != "" for line in out.splitlines())
    x, y = (ROOT / a).read_text().splitlines(), (ROOT / b).read_text().splitlines()
    ops = difflib.SequenceMatcher(None, x, y, autojunk=False).get_opcodes()
    return sum((i2 - i1) + (j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


# a method readable in one sitting, and `diff grpo.py X` a readable account of what it changes
BUDGETS = {"sc_grpo.py": (450, 300), "grpo_lambda.py": (450, 220), "ep_grpo.py": (450, 300), "srpo.py": (520, 450)}


@pytest.mark.parametrize("script", sorted(BUDGETS))
def test_each_script_and_its_diff_from_grpo_py_stay_within_budget(script):
    lines, diff = BUDGETS[script]
    assert len((ROOT / script).read_text().splitlines()) <= lines
    assert changed_lines("grpo.py", script) <= diff
