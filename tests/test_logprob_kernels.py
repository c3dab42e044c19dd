"""The log-prob kernels (logprob_kernels.py) against float64 autograd, and the fused path's once-per-model check."""

import pytest
import torch
from helpers import padded_batch, random_model

import common
from rlvr_utils.core import logprob_kernels
from rlvr_utils.extras import unfused
from rlvr_utils.methods import teacher


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_selected_logprob_forward_and_gradient_match_float64_autograd(temperature, chunk):
    g = torch.Generator().manual_seed(2)
    z = torch.randn(3, 7, 50, generator=g) * 3
    y = torch.randint(0, 50, (3, 7), generator=g)
    w = torch.randn(3, 7, generator=g)  # an arbitrary upstream gradient
    z64 = z.double().requires_grad_(True)
    ref = torch.log_softmax(z64 / temperature, -1).gather(-1, y[..., None]).squeeze(-1)
    (ref * w).sum().backward()
    z32 = z.clone().requires_grad_(True)
    got = unfused.SelectedLogProb.apply(z32, y, temperature, chunk)
    (got * w).sum().backward()
    assert got.dtype == torch.float32 and torch.allclose(got.double(), ref, atol=1e-5)
    assert torch.allclose(z32.grad.double(), z64.grad, atol=1e-6)
    zb = z.bfloat16().requires_grad_(True)  # model-dtype logits: fp32 math inside, the gradient in that dtype
    (unfused.SelectedLogProb.apply(zb, y, temperature, chunk) * w).sum().backward()
    zb64 = zb.detach().double().requires_grad_(True)  # the reference on the same (rounded) logits
    (torch.log_softmax(zb64 / temperature, -1).gather(-1, y[..., None]).squeeze(-1) * w).sum().backward()
    assert zb.grad.dtype == torch.bfloat16 and torch.allclose(zb.grad.double(), zb64.grad, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_logprob_forward_entropy_and_gradients_match_float64_autograd(temperature, chunk, bias):
    g = torch.Generator().manual_seed(3)
    N, H, V = 11, 8, 40
    h, W = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    b = torch.randn(V, generator=g) if bias else None
    y, w = torch.randint(0, V, (N,), generator=g), torch.randn(N, generator=g)
    h64, W64 = h.double().requires_grad_(True), W.double().requires_grad_(True)
    b64 = b.double().requires_grad_(True) if bias else None
    logp64 = torch.log_softmax(torch.nn.functional.linear(h64, W64, b64) / temperature, -1)
    ref = logp64.gather(-1, y[:, None]).squeeze(-1)
    ref_ent = -(logp64.exp() * logp64).sum(-1).detach()
    (ref * w).sum().backward()
    h32, W32 = h.clone().requires_grad_(True), W.clone().requires_grad_(True)
    b32 = b.clone().requires_grad_(True) if bias else None
    got, ent = logprob_kernels.FusedLinearLogProb.apply(h32, W32, b32, y, temperature, chunk, True)
    (got * w).sum().backward()
    assert got.dtype == torch.float32 and torch.allclose(got.double(), ref, atol=1e-5)
    assert not ent.requires_grad and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    assert torch.allclose(h32.grad.double(), h64.grad, atol=1e-5)
    assert torch.allclose(W32.grad.double(), W64.grad, atol=1e-5)
    if bias:
        assert torch.allclose(b32.grad.double(), b64.grad, atol=1e-5)
    # bf16 weights: fp32 softmax inside, gradients back in bf16, against float64 on the same rounded values
    hb, Wb = h.bfloat16().requires_grad_(True), W.bfloat16().requires_grad_(True)
    (logprob_kernels.FusedLinearLogProb.apply(hb, Wb, None, y, temperature, chunk, False)[0] * w).sum().backward()
    hb64, Wb64 = hb.detach().double().requires_grad_(True), Wb.detach().double().requires_grad_(True)
    lp = torch.log_softmax(torch.nn.functional.linear(hb64, Wb64) / temperature, -1).gather(-1, y[:, None]).squeeze(-1)
    (lp * w).sum().backward()
    assert hb.grad.dtype == Wb.grad.dtype == torch.bfloat16
    assert torch.allclose(hb.grad.double(), hb64.grad, rtol=2e-2, atol=2e-2)
    assert torch.allclose(Wb.grad.double(), Wb64.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_kl_forward_and_student_gradients_match_float64_autograd(temperature, chunk, bias):
    g = torch.Generator().manual_seed(4)
    N, H, V = 9, 8, 40
    hs, ht, W = torch.randn(N, H, generator=g), torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    b = torch.randn(V, generator=g) if bias else None
    w = torch.randn(N, generator=g)  # an arbitrary upstream gradient
    hs64, W64 = hs.double().requires_grad_(True), W.double().requires_grad_(True)
    b64 = b.double().requires_grad_(True) if bias else None
    with torch.no_grad():  # the teacher: stop-gradient, also through the shared W
        lt = torch.log_softmax(torch.nn.functional.linear(ht.double(), W.double(), b64) / temperature, -1)
    ls = torch.log_softmax(torch.nn.functional.linear(hs64, W64, b64) / temperature, -1)
    ref = (lt.exp() * (lt - ls)).sum(-1)
    (ref * w).sum().backward()
    hs32, ht32, W32 = hs.clone().requires_grad_(True), ht.clone().requires_grad_(True), W.clone().requires_grad_(True)
    b32 = b.clone().requires_grad_(True) if bias else None
    got = teacher.FusedLinearKL.apply(hs32, ht32, W32, b32, temperature, chunk)
    (got * w).sum().backward()
    assert got.dtype == torch.float32 and torch.allclose(got.double(), ref, atol=1e-5) and (ref > 0).all()
    assert torch.allclose(hs32.grad.double(), hs64.grad, atol=1e-5) and ht32.grad is None
    assert torch.allclose(W32.grad.double(), W64.grad, atol=1e-5)
    if bias:
        assert torch.allclose(b32.grad.double(), b64.grad, atol=1e-5)
    with torch.no_grad():  # SC-GRPO's weights: the same values, no graph
        assert torch.equal(teacher.FusedLinearKL.apply(hs32, ht32, W32, b32, temperature, chunk), got.detach())
    assert (teacher.FusedLinearKL.apply(hs, hs, W, b, temperature, chunk).abs() < 1e-6).all()  # KL(p || p) = 0


@pytest.mark.parametrize("tied", [False, True])
def test_fused_and_unfused_token_logprobs_give_the_same_values_and_parameter_gradients(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(4)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=61,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=tied,
        )
    )
    ids, attn, cmask, T = padded_batch([[1, 2, 3], [4], [5, 6]], [[7, 8], [9, 10, 11], [12]])
    w = torch.randn(3, T)
    grads = {}
    for fused in (True, False):
        model.zero_grad()
        logp, ent = common.token_logprobs(model, ids, attn, T, 0.8, chunk_size=2, with_entropy=True, fused=fused)
        (logp * w * cmask).sum().backward()
        grads[fused] = (logp.detach(), ent, [p.grad.clone() for p in model.parameters()])
    (lp1, e1, g1), (lp0, e0, g0) = grads[True], grads[False]
    assert torch.allclose(lp1, lp0, atol=1e-6) and torch.allclose(e1, e0, atol=1e-5)
    assert len(g1) == len(g0) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g1, g0))
    assert any(a.abs().sum() > 0 for a in g1)


def test_fused_path_never_runs_the_lm_head_on_a_position_and_falls_back_for_scaled_logits():
    model = random_model(5)
    ids, attn, cmask, T = padded_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]])
    assert logprob_kernels.fused_logprobs_ok(model)
    rows = []
    hook = model.lm_head.register_forward_hook(lambda m, inp, out: rows.append(inp[0].shape[1]))
    common.token_logprobs(model, ids, attn, T)[0].sum().backward()
    hook.remove()
    assert rows == [0]  # the logits of no position were computed; the lm_head ran inside FusedLinearLogProb
    # a model whose logits are not lm_head(hidden) (here: scaled, as soft-capping models do) is detected
    from transformers import Qwen2ForCausalLM

    class Scaled(Qwen2ForCausalLM):
        def forward(self, *a, **k):
            out = super().forward(*a, **k)
            out.logits = out.logits * 2
            return out

    scaled = Scaled(model.config).eval()
    scaled.load_state_dict(model.state_dict())
    assert not logprob_kernels.fused_logprobs_ok(scaled)
    with torch.no_grad():
        got = common.token_logprobs(scaled, ids, attn, T)[0]
        want = torch.log_softmax(scaled(input_ids=ids, attention_mask=attn).logits[:, -T - 1 : -1], -1)
    want = want.gather(-1, ids[:, -T:, None]).squeeze(-1)
    assert torch.allclose(got[0], want[0], atol=1e-5)  # row 0 has no left padding: positions agree
    # a quantized-style Linear subclass (int8 weight + scale) that F.linear cannot use directly: fallback, no crash

    class Int8Linear(torch.nn.Linear):
        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight.float() * self.scale)

    q = random_model(5)
    w = q.lm_head.weight.detach()
    lin = Int8Linear(w.shape[1], w.shape[0], bias=False)
    lin.scale = w.abs().max() / 127
    lin.weight = torch.nn.Parameter((w / lin.scale).round().to(torch.int8), requires_grad=False)
    q.lm_head = lin
    assert not logprob_kernels.fused_logprobs_ok(q)
    with torch.no_grad():
        assert torch.isfinite(common.token_logprobs(q, ids, attn, T)[0]).all()
