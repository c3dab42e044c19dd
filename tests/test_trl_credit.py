"""docs/trl.md, "Use a method's credit in TRL": each class runs as the page writes it (its python blocks, extracted),
trains 2 steps of TRL's GRPOTrainer on the bundled model and the arith prompts, and gives the credit this project's
functions give. GRPO-λ: the gradient of its loss with respect to each token's log-prob, over the token's advantage, is
trace_multipliers' closed form (on-policy). EP-GRPO and SC-GRPO: the [B, T] advantages TRL's loss was given are the
rows the hook made, and the hook's equal the project's functions fed independently (TRL's own log-prob pass and
reference pass, the rewards from the reward function called again; SC-GRPO's D from the unfused token_kl on full
logits, one unpadded row at a time). Without trl: skipped, saying so (.ci/run's TRL environment installs it)."""

import re

import pytest
import torch
from conftest import ROOT, TINY_MODEL

pytest.importorskip(
    "trl", reason="trl is not installed: .ci/run installs it (with mlflow) in an environment of its own"
)

import common  # noqa: E402
from ep_grpo import ep_advantages  # noqa: E402
from grpo_lambda import clamp_negative_advantages  # noqa: E402
from rlvr_utils.core import tasks  # noqa: E402
from rlvr_utils.methods import trace_diagnostics  # noqa: E402
from sc_grpo import (  # noqa: E402
    SCConfig,
    build_teachers,
    route_groups,
    teacher_prompt,
    token_kl,
    weighted_tokens,
    weights_and_advantages,
)

G = 8  # completions per prompt; two prompts per step


def _blocks(*names: str) -> dict:
    """The page's python blocks marked `# trl_credit: NAME`, run in order in one namespace, as written."""
    text = (ROOT / "docs" / "trl.md").read_text()
    found = dict(re.findall(r"```python\n# trl_credit: (\w+)\n(.*?)```", text, flags=re.S))
    namespace: dict = {}
    for name in names:
        exec(compile(found[name], f"docs/trl.md:{name}", "exec"), namespace)
    return namespace


def arith(prompts, completions, answer, **kwargs):
    """The built-in task's verifier in TRL's convention: 1.0 for the right final answer."""
    return [tasks.arith_reward(c, a) for c, a in zip(completions, answer)]


def _trainer(cls, tmp_path, **settings):
    from datasets import Dataset
    from trl import GRPOConfig

    tok = common.load_tokenizer(str(TINY_MODEL))
    task = tasks.load_task("arith", tok, seed=1, num_eval=4)
    rows = Dataset.from_list([{"prompt": e.prompt, "answer": e.gold} for e in task.train[:32]])
    config = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=48,
        temperature=1.0, learning_rate=1e-4, max_steps=2, report_to="none", save_strategy="no", use_cpu=True,
        bf16=False, seed=1, disable_tqdm=True, dataloader_num_workers=0, logging_steps=1, **settings,
    )  # fmt: skip
    model = common.load_policy(str(TINY_MODEL), torch.device("cpu"))[0]
    return cls(model=model, reward_funcs=arith, args=config, train_dataset=rows, processing_class=tok)


def _batch(out):
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    return ids, torch.cat([out["prompt_mask"], out["completion_mask"]], 1), out["completion_ids"].shape[1]


def _spy_loss(trainer) -> list[dict]:
    """Every compute_loss call's inputs (the public hook TRL's loss goes through), kept."""
    seen, real = [], trainer.compute_loss

    def spy(model, inputs, *args, **kwargs):
        seen.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        return real(model, inputs, *args, **kwargs)

    trainer.compute_loss = spy
    return seen


def _train(trainer) -> None:
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))  # it trained


def _rewards(trainer, out, inputs) -> torch.Tensor:
    """The rewards of the batch's completions, from the reward function called again on their text."""
    mask = out["completion_mask"].bool()
    texts = trainer.processing_class.batch_decode(
        [c[m] for c, m in zip(out["completion_ids"], mask)], skip_special_tokens=True
    )
    return torch.tensor(arith(None, texts, [x["answer"] for x in inputs]))


def _same_rows(seen: list[dict], made: list[dict]) -> None:
    """The advantages TRL's loss was given are the hook's, row for row (TRL shuffles the rows of a batch)."""
    key = lambda d, i: (tuple(d["prompt_ids"][i].tolist()), tuple(d["completion_ids"][i].tolist()))  # noqa: E731
    for inputs, out in zip(seen, made):
        assert inputs["advantages"].shape == inputs["completion_ids"].shape  # [B, T] reached the loss
        rows = {}  # the same rollout twice in a group may get two teachers (SC-GRPO): each row one of them
        for i in range(len(out["advantages"])):
            rows.setdefault(key(out, i), []).append(out["advantages"][i])
        for i in range(len(inputs["advantages"])):
            assert any(torch.equal(inputs["advantages"][i], a) for a in rows[key(inputs, i)]), i


@pytest.mark.slow
def test_grpo_lambda_in_trl_gives_the_closed_form_credit(tmp_path):
    ns = _blocks("grpo_lambda")
    trainer = _trainer(ns["GRPOLambdaTrainer"], tmp_path, loss_type="dapo", beta=0.0)
    seen = _spy_loss(trainer)
    _train(trainer)
    inputs = seen[0]  # step 1: on-policy (TRL computed no old log-probs)
    assert "old_per_token_logps" not in inputs
    mask = inputs["completion_mask"].bool()
    logp = torch.randn(mask.shape, dtype=torch.float32, requires_grad=True)  # on-policy the ratio is 1 at any logp
    trainer.model.eval()  # the loss's normalizer: the batch's tokens
    g = torch.autograd.grad(trainer.lambda_loss(logp, inputs), logp)[0]
    A = clamp_negative_advantages(inputs["advantages"], trainer.cfg.adv_floor)[:, None].expand_as(g)
    credit = -g * inputs["num_items_in_batch"] / torch.where(A != 0, A, 1.0)
    cfg = trainer.cfg
    c = trace_diagnostics.trace_multipliers(mask.sum(1), cfg.lam, cfg.gamma, cfg.style, T=mask.shape[1])
    rows = mask & (A != 0)
    assert rows.any() and (c[rows] > 1.5).any()  # early tokens carry many times GRPO's credit
    torch.testing.assert_close(credit[rows], c[rows], rtol=1e-5, atol=1e-5)


def _spy_hook(trainer, reference) -> list[dict]:
    """Every training batch the hook made, with `reference(out, inputs)`'s advantages beside them, computed at the
    same weights (before the step's update)."""
    made, real = [], trainer._generate_and_score_completions

    def spy(inputs):
        state = trainer.routing.get_state() if hasattr(trainer, "routing") else None
        out = real(inputs)
        if trainer.model.training:
            assert all(x["prompt"] == inputs[i - i % G]["prompt"] for i, x in enumerate(inputs))  # G rows a prompt
            made.append({**out, "want": reference(out, inputs, state)})
        return out

    trainer._generate_and_score_completions = spy
    return made


@pytest.mark.slow
def test_ep_grpo_in_trl_gives_ep_advantages(tmp_path):
    ns = _blocks("groups", "ep_grpo")
    trainer = _trainer(ns["EPGRPOTrainer"], tmp_path, loss_type="dapo", beta=1e-3)

    def reference(out, inputs, state):
        ids, attn, T = _batch(out)
        with torch.no_grad():  # TRL's own passes: the policy's entropy and log-probs, the reference's
            logp, entropy, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, attn, T, compute_entropy=True
            )
            ref = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attn, T)[0]
        rewards = _rewards(trainer, out, inputs)
        return ep_advantages(entropy, logp, ref, out["completion_mask"], rewards, G, cfg=trainer.cfg)

    made, seen = _spy_hook(trainer, reference), _spy_loss(trainer)
    _train(trainer)
    assert len(made) == 2 and len(seen) == 2
    for out in made:
        mask = out["completion_mask"].bool()
        torch.testing.assert_close(out["advantages"], out["want"], rtol=1e-4, atol=1e-5)
        assert (out["advantages"][mask] != out["advantages"][mask][0]).any()  # per token, not per row
    _same_rows(seen, made)


@pytest.mark.slow
def test_sc_grpo_in_trl_gives_its_weighted_advantages(tmp_path):
    ns = _blocks("groups", "sc_grpo")
    trainer = _trainer(ns["SCGRPOTrainer"], tmp_path, loss_type="grpo", beta=0.0)
    tok = trainer.processing_class

    def reference(out, inputs, state):
        mask = out["completion_mask"]
        N, T = mask.shape
        rewards, gid = _rewards(trainer, out, inputs), torch.arange(N) // G
        A = common.group_advantages(rewards, G, "group", 1e-6, gid, unbiased=False)
        correct, routing = rewards >= 1.0, torch.Generator()
        routing.set_state(state)  # the draws the hook made
        _, tau_row = route_groups(correct, G, routing, gid, scores=rewards)
        texts = tok.batch_decode([c[m.bool()] for c, m in zip(out["completion_ids"], mask)], skip_special_tokens=True)
        examples = {g: tasks.Example(g, "", "", inputs[g * G]["prompt"], [], meta={"chat": False}) for g in range(2)}
        limit = trainer.model.config.max_position_embeddings - T
        make = lambda i, tau: teacher_prompt(tok, "custom", examples[int(gid[i])], tau)  # noqa: E731
        teachers, role, wlen, _ = build_teachers(tok, make, texts, mask, gid, correct, tau_row, limit, 8192, routing)
        assert (role == 1).any()  # some rollouts have a teacher
        D = torch.zeros(N, T)
        for i in [i for i, p in enumerate(teachers) if p is not None]:  # the unfused D, one unpadded row at a time
            completion = out["completion_ids"][i][mask[i].bool()]
            prompt = out["prompt_ids"][i][out["prompt_mask"][i].bool()]
            D[i, : len(completion)] = token_kl(
                _logits(trainer.model, torch.tensor(teachers[i]), completion),
                _logits(trainer.model, prompt, completion),
            )
        active = weighted_tokens(mask, role, wlen)
        w, adv, _ = weights_and_advantages(D, active, role, gid, A[:, None].expand(-1, T).clone(), SCConfig())
        return adv * w

    made, seen = _spy_hook(trainer, reference), _spy_loss(trainer)
    _train(trainer)
    assert len(made) == 2 and len(seen) == 2
    for out in made:
        torch.testing.assert_close(out["advantages"], out["want"], rtol=1e-4, atol=1e-5)
    _same_rows(seen, made)


def _logits(model, prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """The model's logits [L, V] at the positions that predict `completion` after `prompt` (no padding; at the
    sampling temperature 1)."""
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, completion])[None]).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)].float()
