"""common.py against references: token log-probs (and the training layout), group advantages, loss aggregation,
rollouts, checkpoints, gradient checkpointing."""

import math

import pytest
import torch
from helpers import padded_batch, random_model

import common
from rlvr_utils.core import logprob_kernels, rollouts, runtime
from rlvr_utils.extras.save import saving


def _reference(model64, prompt, completion, temperature):
    """float64, one unpadded sequence at a time, full log_softmax."""
    ids = torch.tensor([prompt + completion])
    logits = model64(input_ids=ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    logp = torch.log_softmax(logits, -1)
    tok = logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return tok, ent


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 3, 16])
def test_token_logprobs_matches_float64_reference(temperature, chunk_size, fused):
    g = torch.Generator().manual_seed(1)
    model = random_model()
    model64 = random_model().double()
    prompts = [torch.randint(1, 61, (n,), generator=g).tolist() for n in (5, 2, 7, 3, 1)]  # left padding
    completions = [torch.randint(1, 61, (n,), generator=g).tolist() for n in (4, 9, 1, 6, 9)]  # right padding
    ids, attn, cmask, T = padded_batch(prompts, completions)
    with torch.no_grad():
        logp, ent = common.token_logprobs(
            model, ids, attn, T, temperature, chunk_size=chunk_size, with_entropy=True, fused=fused
        )
        logp_only, none = common.token_logprobs(model, ids, attn, T, temperature, chunk_size=chunk_size, fused=fused)
    assert logprob_kernels.fused_logprobs_ok(model)  # a Qwen2 model: the default is the fused path
    assert none is None and logp.shape == (5, T) and ent.shape == (5, T)
    assert torch.equal(logp, logp_only)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ref_lp, ref_ent = _reference(model64, p, c, temperature)
        assert torch.allclose(logp[i, : len(c)].double(), ref_lp, atol=1e-5), (i, logp[i], ref_lp)
        assert torch.allclose(ent[i, : len(c)].double(), ref_ent, atol=1e-5)
    assert torch.isfinite(logp).all()


def test_token_logprobs_gradient_flows_and_entropy_chunks():
    model = random_model()
    ids, attn, cmask, T = padded_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]])
    logp, ent = common.token_logprobs(model, ids, attn, T, with_entropy=True, entropy_chunk=1)
    (logp * cmask).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert not ent.requires_grad
    _, ent_big = common.token_logprobs(model, ids, attn, T, with_entropy=True, entropy_chunk=64)
    assert torch.allclose(ent, ent_big, atol=1e-6)


def test_token_logprobs_agree_with_generate_scores():
    """The trainer scores sampled tokens exactly as generate() sampled them (positions under
    left padding, temperature), so the on-policy ratio is 1."""

    class Tok:
        pad_token_id, eos_token_id = 0, 60

    model = random_model(3)
    model.generation_config.eos_token_id = 60
    prompts = [[5, 6, 7, 8], [9, 10], [11]]
    torch.manual_seed(0)
    ids, mask = common.pad_left(prompts, 0)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=True,
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
        eos_token_id=60,
        return_dict_in_generate=True,
        output_logits=True,
    )
    comp = out.sequences[:, ids.shape[1] :]
    cmask, _ = rollouts.completion_mask_from_ids(comp, [60])
    gen_logp = torch.stack([torch.log_softmax(z.float() / 0.7, -1) for z in out.logits], 1)
    gen_logp = gen_logp.gather(-1, comp[..., None]).squeeze(-1)
    with torch.no_grad():
        logp, _ = common.token_logprobs(
            model, torch.cat([ids, comp], 1), torch.cat([mask, cmask], 1), comp.shape[1], 0.7
        )
    m = cmask.bool()
    assert torch.allclose(logp[m], gen_logp[m], atol=1e-4)


def test_completion_mask_from_ids():
    comp = torch.tensor([[3, 4, 9, 0, 0], [9, 0, 0, 0, 0], [1, 2, 3, 4, 5], [1, 9, 2, 9, 3]])
    mask, trunc = rollouts.completion_mask_from_ids(comp, [9])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert trunc.tolist() == [False, False, True, False]


def test_group_advantages_hand_cases():
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1])
    a = common.group_advantages(r, 4)
    std = 0.5  # unbiased std of [1,0,0,0]: sqrt((0.75^2 + 3 * 0.25^2) / 3)
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-4)
    assert torch.allclose(a[:4], expected, atol=1e-6)
    assert torch.equal(a[4:], torch.zeros(4))  # all-equal group: exactly 0
    assert torch.allclose(common.group_advantages(r, 4, "none"), torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    batch_std = r.std().item()
    assert torch.allclose(
        common.group_advantages(r, 4, "batch")[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (batch_std + 1e-4)
    )
    assert torch.equal(common.group_advantages(r, 4, "batch")[4:], torch.zeros(4))


def test_group_advantages_all_equal_never_nan():
    for v in (0.1, 1 / 3, 0.0, 1.0, 7.7):
        r = torch.full((6,), v)
        for scale in ("group", "batch", "none"):
            a = common.group_advantages(r, 3, scale)
            assert torch.equal(a, torch.zeros(6)), (v, scale)
    a = common.group_advantages(torch.tensor([1.0, 0.0]), 1)  # G = 1: every group is constant
    assert torch.equal(a, torch.zeros(2))


def test_group_advantages_keyed_by_id_not_position():
    r = torch.tensor([1.0, 0, 0.5, 0, 1, 0.25])
    contiguous = common.group_advantages(r, 3)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    ids = torch.tensor([7, 7, 7, 2, 2, 2])
    shuffled = common.group_advantages(r[perm], 3, group_ids=ids[perm])
    assert torch.allclose(shuffled, contiguous[perm])
    with pytest.raises(ValueError, match="every group"):
        common.group_advantages(r, 3, group_ids=torch.tensor([1, 1, 1, 1, 2, 2]))
    with pytest.raises(ValueError, match="whole number"):
        common.group_advantages(r, 4)
    with pytest.raises(ValueError, match="unknown scale"):
        common.group_advantages(r, 3, "rank")


def test_aggregate_loss_hand_cases():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert common.aggregate_loss(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert common.aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert common.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", 5).item() == pytest.approx(10 / (2 * 5))
    with pytest.raises(ValueError):
        common.aggregate_loss(loss, mask, "sum")
    empty = torch.zeros((1, 3), dtype=torch.long)
    for mode in common.LOSS_AGG_MODES:
        assert common.aggregate_loss(loss[:1], empty, mode, 5).item() == 0.0  # no tokens: 0, not NaN


@pytest.mark.parametrize("mode", common.LOSS_AGG_MODES)
def test_aggregate_loss_micro_batches_add_up(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(10, 7, generator=g)
    mask = (torch.rand(10, 7, generator=g) > 0.3).long()
    whole = common.aggregate_loss(loss, mask, mode, 7)
    parts = sum(
        common.aggregate_loss(loss[s : s + 3], mask[s : s + 3], mode, 7, num_tokens=mask.sum().item(), num_seqs=10)
        for s in range(0, 10, 3)
    )
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)


def test_prompt_batches_cover_epoch_and_reject_empty():
    items = list(range(10))
    stream = common.prompt_batches(items, 5, seed=0)
    first_epoch = next(stream) + next(stream)
    assert sorted(first_epoch) == items
    with pytest.raises(ValueError, match="1 to 0 distinct prompts per batch"):
        next(common.prompt_batches([], 4, 0))
    with pytest.raises(ValueError, match="1 to 10 distinct prompts per batch \\(10 prompts\\), got 0"):
        next(common.prompt_batches(items, 0, 0))
    with pytest.raises(ValueError, match="got 11"):
        next(common.prompt_batches(items, 11, 0))


def test_stop_if_nonfinite():
    common.stop_if_nonfinite(torch.tensor(1.0), "loss", 3, {})
    with pytest.raises(SystemExit, match="non-finite loss .* at step 3"):
        common.stop_if_nonfinite(torch.tensor(math.nan), "loss", 3, {"reward": 0.5})


def test_save_model_atomic_refuses_nan_and_replaces(tmp_path):
    from transformers import AutoModelForCausalLM

    class Tok:
        def save_pretrained(self, d):
            (d / "tokenizer.json").write_text("{}")

    model = random_model()
    out = saving.save_model_atomic(model, Tok(), tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    saving.save_model_atomic(model, Tok(), tmp_path / "ckpt")  # overwrite in place
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        saving.save_model_atomic(model, Tok(), tmp_path / "ckpt2")
    assert not (tmp_path / "ckpt2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left behind


def test_group_advantages_variable_sizes_and_population_std():
    r = torch.tensor([1.0, 0, 0, 0, 1, 0, 1, 0, 1, 1])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    a = common.group_advantages(r, None, eps=0.0, group_ids=ids, unbiased=False)
    pop = torch.tensor([1.0, 0, 0, 0]).std(unbiased=False)
    assert torch.allclose(a[:4], (torch.tensor([1.0, 0, 0, 0]) - 0.25) / pop)
    g2 = r[4:]
    assert torch.allclose(a[4:], (g2 - g2.mean()) / g2.std(unbiased=False))
    assert torch.allclose(common.group_advantages(r[:4], 4, eps=0.0, unbiased=False), a[:4])


def test_bundled_tokenizer_round_trips_spaces_and_newlines(tiny):
    """AutoTokenizer would load the bundled character tokenizer as Qwen2Tokenizer (from config.json)
    and drop every space and newline; load_policy must load it as saved."""
    _, tok = tiny
    for text in ("Solve: 23+7-5+9\n", "23+7=30\n30-5=25\n#### 25", "Step 1: 2+2=4\n\\boxed{1}"):
        ids = tok(text, add_special_tokens=False).input_ids
        assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.padding_side == "left" and tok.pad_token_id is not None and tok.eos_token_id is not None


def test_make_rollouts_pads_and_flags():
    class Tok:
        pad_token_id = 0

        def batch_decode(self, seqs, skip_special_tokens=True):
            return ["".join(chr(96 + t) for t in s if t not in (0, 9)) for s in seqs]

    ro = common.make_rollouts(Tok(), [[1, 2, 3], [4]], [[5, 9], [6, 7, 8]], [11, 12], stop_ids=[9])
    assert ro.prompt_ids.tolist() == [[1, 2, 3], [0, 0, 4]] and ro.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert ro.completion_ids.tolist() == [[5, 9, 0], [6, 7, 8]] and ro.completion_mask.tolist() == [
        [1, 1, 0],
        [1, 1, 1],
    ]
    assert ro.truncated.tolist() == [False, True] and ro.group_ids.tolist() == [11, 12]
    assert ro.texts == ["e", "fgh"] and ro.input_ids.shape == (2, 6)


def _spy_sdpa(monkeypatch):
    """Record the attention masks reaching torch's scaled_dot_product_attention."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *a, **kw):
        seen.append((attn_mask, kw.get("is_causal", False), q.shape[-2], k.shape[-2]))
        return real(q, k, v, attn_mask, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def _fully_masked_rows(attn_mask, is_causal, q_len, k_len) -> int:
    """Query rows that may attend to no key at all."""
    if attn_mask is None:
        return 0  # no mask (is_causal: every row sees at least its own key)
    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min / 2
    allowed = allowed.expand(*allowed.shape[:-2], q_len, k_len)
    return int((~allowed.any(-1)).sum())


@pytest.mark.parametrize("fused", [True, False])
def test_no_attention_query_row_is_fully_masked_on_a_left_padded_batch(monkeypatch, fused):
    """Regression (GPU NaN, issue 17): left-pad positions used to be query rows with no key to attend to, which
    cuDNN's bf16 attention backward turns into NaN. Every forward of token_logprobs (and the teacher forward of
    SC-GRPO, through completion_logits) must hand attention a mask in which every query row sees a key."""
    from rlvr_utils.methods import teacher

    g = torch.Generator().manual_seed(3)
    model = random_model()
    prompts = [torch.randint(1, 61, (n,), generator=g).tolist() for n in (2, 7, 4, 7)]
    completions = [torch.randint(1, 61, (n,), generator=g).tolist() for n in (5, 1, 3, 5)]
    ids, attn, cmask, T = padded_batch(prompts, completions)
    seen = _spy_sdpa(monkeypatch)
    common.token_logprobs(model, ids, attn, T, fused=fused)[0].sum().backward()
    teacher_ids = [[5, 6, 7], None, [8], [9, 10, 11, 12, 13, 14, 15, 16]]
    student = []
    common.token_logprobs(model, ids, attn, T, keep=student)
    teacher.teacher_kl(model, student, ids, attn, T, teacher_ids)
    assert len(seen) >= 3 * 2  # two layers x (student, SC-GRPO student, teacher)
    assert all(_fully_masked_rows(*s) == 0 for s in seen), [_fully_masked_rows(*s) for s in seen]


def test_right_padded_layout_keeps_tokens_positions_and_predicting_columns():
    ids = torch.tensor([[0, 0, 3, 4, 5, 6, 0], [1, 2, 3, 4, 5, 0, 0], [0, 0, 0, 9, 8, 7, 6]])
    mask = (ids != 0).long()
    T = 3  # the completion is the last 3 columns
    r_ids, r_mask, pos, keep = logprob_kernels.right_padded(ids, mask, T)
    assert r_ids.shape[1] == 7  # the second row has no left padding: nothing to drop
    for b in range(3):
        n = int(mask[b].sum())
        assert (
            r_ids[b, :n].tolist() == ids[b][mask[b].bool()].tolist() and r_mask[b, :n].all() and not r_mask[b, n:].any()
        )
        assert pos[b, :n].tolist() == list(range(n))
        want = ids[b, -T:]  # each kept column is followed by the token it predicts
        shift = int((mask[b].cumsum(0) == 0).sum())
        for t in range(T):
            if mask[b, -T + t]:
                assert r_ids[b, keep[b, t] + 1] == want[t]
        assert keep[b].tolist() == [7 - T - 1 - shift + t for t in range(T)]
    trimmed = logprob_kernels.right_padded(ids[[0, 2]], mask[[0, 2]], T)[0]
    assert trimmed.shape[1] == 5  # both rows have >= 2 left pads: two all-padding columns are dropped
    with pytest.raises(ValueError, match="no token"):
        logprob_kernels.right_padded(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), 2)


def test_eager_and_sdpa_attention_give_the_same_log_probs_on_a_padded_batch():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    sdpa = Qwen2ForCausalLM(cfg).eval()
    eager = Qwen2ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    eager.load_state_dict(sdpa.state_dict())
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 61, (n,), generator=g).tolist() for n in (1, 6, 3)]
    completions = [torch.randint(1, 61, (n,), generator=g).tolist() for n in (4, 2, 6)]
    ids, attn, cmask, T = padded_batch(prompts, completions)
    for fused in (True, False):
        a = common.token_logprobs(sdpa, ids, attn, T, fused=fused)[0]
        b = common.token_logprobs(eager, ids, attn, T, fused=fused)[0]
        assert torch.allclose(a * cmask, b * cmask, atol=1e-5)


def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_gradients(tiny, tmp_path):
    """load_policy(gradient_checkpointing=True): every decoder layer runs again in the backward (non-reentrant
    checkpointing is active, so the model is in train mode), and the gradients are the same; no dropout is left."""
    from conftest import TINY_MODEL

    model, tok = tiny
    ck, _ = common.load_policy(str(TINY_MODEL), torch.device("cpu"), gradient_checkpointing=True)
    assert ck.training and ck.model.layers[0].gradient_checkpointing
    assert all(m.p == 0 for m in ck.modules() if isinstance(m, torch.nn.Dropout))
    calls = []
    layer = ck.model.layers[0]
    hook = layer.register_forward_pre_hook(lambda *a: calls.append(1))
    prompts = [tok("Solve: 1+2\n").input_ids, tok("Solve: 12+3-4\n").input_ids]
    completions = [tok("1+2=3\n#### 3").input_ids, tok("12+3=15").input_ids]
    ids, attn, cmask, T = padded_batch(prompts, completions, pad=tok.pad_token_id)
    grads = []
    for m in (model, ck):
        m.zero_grad(set_to_none=True)
        (common.token_logprobs(m, ids, attn, T)[0] * cmask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    hook.remove()
    assert len(calls) == 2  # the forward, then the recompute in the backward
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6, rtol=1e-4), n
    model.zero_grad(set_to_none=True)
    with torch.no_grad():  # generation puts it in eval mode and back
        common.generate_rollouts(ck, tok, [prompts[0]], [0], 2, 4)
    assert ck.training
    assert runtime.peak_memory(torch.device("cpu")) == {}


class _Args:
    """The fields rollouts_with_rewards reads."""

    def __init__(self, **kw):
        self.__dict__.update(
            dict(
                num_generations=4,
                prompts_per_step=2,
                max_new_tokens=12,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                gen_batch_size=64,
                dynamic_sampling=False,
                max_sampling_rounds=3,
                overlong_buffer=0,
                overlong_penalty_factor=1.0,
            ),
            **kw,
        )


def _scripted_task(tok, scores_by_id):
    """A task whose reward is looked up by the example id and the completion's index in its group."""
    from rlvr_utils.core import tasks

    task = tasks.load_task("arith", tok, seed=0, num_eval=2, arith_num_train=50)
    seen = {}

    def reward(completion, ex):
        seen[ex.id] = seen.get(ex.id, -1) + 1
        return scores_by_id(ex.id, seen[ex.id])

    task.reward_fn = reward
    return task


def test_dynamic_sampling_drops_constant_groups_and_refills(tiny):
    """Prompts with an even id get all-equal rewards (no signal): with --dynamic-sampling they are dropped and more
    prompts are drawn until the batch holds prompts_per_step groups with a signal."""

    model, tok = tiny
    task = _scripted_task(tok, lambda i, k: 1.0 if i % 2 == 0 else float(k % 2))
    batches = common.prompt_batches(task.train, 2, seed=3)
    ro, rewards, info = common.rollouts_with_rewards(
        model, tok, task, batches, runtime.Dist(), _Args(dynamic_sampling=True, max_sampling_rounds=10)
    )
    assert len(ro) == 8 and all(int(g) % 2 == 1 for g in ro.group_ids)  # only groups with a signal were kept
    assert info["sampling/groups_kept"] == 1.0 and info["sampling/prompts_drawn"] >= 2
    assert torch.equal(rewards, ro.scores) and rewards.tolist() == [0.0, 1.0] * 4
    assert info["sampling/generated_tokens"] >= info["num_tokens"]
    assert list(ro.input_ids.shape) == [8, ro.prompt_ids.shape[1] + ro.completion_ids.shape[1]]
    # without it, the first batch is trained whatever its rewards
    ro2, _, info2 = common.rollouts_with_rewards(
        model, tok, task, common.prompt_batches(task.train, 2, seed=3), runtime.Dist(), _Args()
    )
    assert "sampling/groups_kept" not in info2 and len(ro2) == 8


def test_dynamic_sampling_fills_with_dropped_groups_when_rounds_run_out(tiny):

    model, tok = tiny
    task = _scripted_task(tok, lambda i, k: 0.0)  # nothing ever has a signal
    ro, rewards, info = common.rollouts_with_rewards(
        model,
        tok,
        task,
        common.prompt_batches(task.train, 2, seed=0),
        runtime.Dist(),
        _Args(dynamic_sampling=True, max_sampling_rounds=2),
    )
    assert (
        len(ro) == 8
        and info["sampling/rounds"] == 2
        and info["sampling/groups_kept"] == 0.0
        and info["sampling/prompts_drawn"] == 4
    )
    keep = lambda s: True  # noqa: E731 - SC-GRPO keeps its solve-none groups
    ro, _, info = common.rollouts_with_rewards(
        model,
        tok,
        task,
        common.prompt_batches(task.train, 2, seed=0),
        runtime.Dist(),
        _Args(dynamic_sampling=True),
        keep,
    )
    assert info["sampling/rounds"] == 1 and info["sampling/groups_kept"] == 1.0


def test_overlong_penalty_is_dapos_linear_ramp(tiny):
    """DAPO: 0 up to max - buffer tokens, then (max - buffer - L) / buffer * factor, -factor at max. Hand values with
    max 48, buffer 16, factor 0.5: L <= 32 -> 0, L = 40 -> -0.25, L = 48 -> -0.5."""

    model, tok = tiny
    task = _scripted_task(tok, lambda i, k: 1.0)
    ro, rewards, info = common.rollouts_with_rewards(
        model,
        tok,
        task,
        common.prompt_batches(task.train, 2, seed=0),
        runtime.Dist(),
        _Args(max_new_tokens=48, overlong_buffer=16, overlong_penalty_factor=0.5),
    )
    L = ro.completion_mask.sum(1).float()
    want = 1.0 + torch.where(L <= 32, 0.0, -(L - 32) / 16 * 0.5)
    assert torch.allclose(rewards, want) and (ro.scores == 1.0).all()
    assert ((L > 32) & (L < 48)).any()  # the tiny model's solutions (~40 tokens) land on the ramp
    assert info["reward/overlong_penalty"] == pytest.approx((want - 1).mean().item())


def test_minibatches_hold_whole_groups_in_order():
    gids = torch.tensor([5, 5, 9, 9, 2, 2, 7, 7])
    mbs = common.minibatches(gids, 2)
    assert [m.tolist() for m in mbs] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    mixed = torch.tensor([5, 9, 5, 9])  # rows of a group need not be adjacent (SRPO's)
    assert [m.tolist() for m in common.minibatches(mixed, 2)] == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="must divide"):
        common.minibatches(gids, 3)


def test_update_stats_hand_values():
    """Clip fractions and kl are token means over every pass, entropy over the first, loss and grad norm per step."""
    st = common.UpdateStats(torch.tensor([[1, 1, 0], [1, 0, 0]]), passes=2)  # 3 tokens
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    ratio = torch.tensor([[0.7, 1.0, 0.1], [1.5, 1.0, 1.0]])
    adv = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]])
    st.add(
        m, ratio, adv, 0.2, 0.28, entropy=torch.full((2, 3), 2.0), kl=torch.full((2, 3), 0.3), loss=torch.tensor(1.0)
    )
    st.step(4.0)
    st.add(m, torch.ones(2, 3), adv, 0.2, 0.28, kl=torch.zeros(2, 3), loss=torch.tensor(3.0))
    st.step(2.0)
    out = st.metrics()
    assert out["clip_ratio/low_mean"] == pytest.approx(1 / 6) and out["clip_ratio/high_mean"] == pytest.approx(1 / 6)
    assert out["clip_ratio/region_mean"] == pytest.approx(2 / 6) and out["entropy"] == pytest.approx(2.0)
    assert out["kl"] == pytest.approx(0.9 / 6) and out["policy_loss"] == 2.0 and out["grad_norm"] == 3.0


def test_engine_correction_truncates_the_engine_ratio_at_the_default_cap():
    """--engine vllm: each token's loss is multiplied by min(pi_old / pi_engine, cap), cap 2 by default (TRL's, verl's
    practice); no engine log-probs (HF generate) or cap 0: exactly 1."""
    import types

    from rlvr_utils.core import cli
    from rlvr_utils.extras.scale import engines

    assert cli.BaseArgs().vllm_is_cap == 2.0
    old = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))
    ro = types.SimpleNamespace(engine_logp=torch.log(torch.tensor([[0.1, 0.9, 0.4]])), engine_released_gb=0.0)
    mask, stats = torch.ones(1, 3), {}
    flags = cli.BaseArgs()  # --vllm-is-cap 2, --vllm-is-mode token-truncate
    w = engines.engine_correction(ro, torch.tensor([0]), old, mask, flags, stats, 3.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.5]]), atol=1e-6)  # ratios 5 (capped), 1, 0.5
    assert stats["vllm/is_ratio_max"] == pytest.approx(5.0, rel=1e-5)
    off = types.SimpleNamespace(vllm_is_cap=0.0, vllm_is_mode="token-truncate", vllm_is_min=0.0)
    assert engines.engine_correction(ro, torch.tensor([0]), old, mask, off, None, 3.0) == 1.0
    no_engine = types.SimpleNamespace(engine_logp=None)
    assert engines.engine_correction(no_engine, None, old, mask, flags, None, 3.0) == 1.0


def test_engine_correction_modes_by_hand():
    """TRL's four modes: token ratios (5, 1, 0.5) and (1, 1, 1); the sequence ratios are their products, 2.5 and 1.
    token-mask zeroes the token over the cap, sequence-truncate caps the row's one ratio, sequence-mask zeroes a row
    whose product exceeds the cap, and a lower bound (mask modes) zeroes ratios under it."""
    import types

    from rlvr_utils.extras.scale import engines

    old = torch.log(torch.tensor([[0.5, 0.9, 0.2], [0.3, 0.3, 0.3]]))
    ro = types.SimpleNamespace(engine_logp=torch.log(torch.tensor([[0.1, 0.9, 0.4], [0.3, 0.3, 0.3]])))
    ro.engine_released_gb = 0.0
    mask, rows = torch.ones(2, 3), torch.tensor([0, 1])

    def w(mode, cap=2.0, floor=0.0, stats=None):
        flags = types.SimpleNamespace(vllm_is_cap=cap, vllm_is_mode=mode, vllm_is_min=floor)
        return engines.engine_correction(ro, rows, old, mask, flags, stats, 6.0)

    assert torch.allclose(w("token-truncate"), torch.tensor([[2.0, 1.0, 0.5], [1.0, 1.0, 1.0]]), atol=1e-6)
    stats = {}
    assert torch.allclose(w("token-mask", stats=stats), torch.tensor([[0.0, 1.0, 0.5], [1.0, 1.0, 1.0]]), atol=1e-6)
    assert stats["vllm/is_masked_frac"] == pytest.approx(1 / 6)
    assert torch.allclose(w("token-mask", floor=0.8), torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]), atol=1e-6)
    assert torch.allclose(w("sequence-truncate"), torch.tensor([[2.0], [1.0]]), atol=1e-6)
    assert torch.allclose(w("sequence-truncate", cap=3.0), torch.tensor([[2.5], [1.0]]), atol=1e-5)
    assert torch.allclose(w("sequence-mask"), torch.tensor([[0.0], [1.0]]), atol=1e-6)
    assert torch.allclose(w("sequence-mask", cap=3.0), torch.tensor([[2.5], [1.0]]), atol=1e-5)


def test_completion_metrics_count_unsolved_groups_by_the_verifier_score():
    """frac_groups_unsolved: groups with no completion at the full verifier score; an overlong penalty (rewards below
    the scores) does not turn a solved group into an unsolved one."""
    import types

    ro = types.SimpleNamespace(
        completion_mask=torch.ones(8, 3),
        truncated=torch.zeros(8, dtype=torch.bool),
        group_ids=torch.tensor([7, 7, 7, 7, 3, 3, 3, 3]),
        scores=torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0]),
    )
    m = runtime.completion_metrics(ro, ro.scores - 0.5, 4)
    assert m["frac_groups_unsolved"] == 0.5 and m["frac_reward_zero_std"] == 0.5
    ro.scores = None  # scripts whose rollouts carry no separate score: the rewards themselves
    assert runtime.completion_metrics(ro, torch.zeros(8), 4)["frac_groups_unsolved"] == 1.0


def test_dynamic_sampling_judges_a_group_by_its_scored_rows(tiny):
    """An unscored completion (reward None: NaN) is neither a signal nor its absence: [1, None, 1, 0] has a signal
    (kept), [1, None, 1, 1] has none (dropped), whatever NaN does to a max or a min."""
    model, tok = tiny
    for scores, kept in (([1.0, math.nan, 1.0, 0.0], 1.0), ([1.0, math.nan, 1.0, 1.0], 0.0)):
        task = _scripted_task(tok, lambda i, k, s=scores: s[k % 4])
        args = _Args(dynamic_sampling=True, max_sampling_rounds=1, max_new_tokens=4)
        _, _, info = common.rollouts_with_rewards(
            model, tok, task, common.prompt_batches(task.train, 2, seed=0), runtime.Dist(), args
        )
        assert info["sampling/groups_kept"] == kept, scores
