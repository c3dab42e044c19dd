"""The static decoder (rlvr_utils/rollouts.StaticDecoder, the default engine) against transformers' `generate`: the same
tokens bitwise (greedy and sampled from one seed, fp32 and bf16, five Llama-family configurations), the same
distribution from independent seeds, log-probs equal to a fresh forward's, the CUDA graph's whole-cache arithmetic,
LoRA decoded from merged copies without touching the base, and a run identical under --engine hf."""

import json
import math
import weakref

import pytest
import torch
from helpers import run_dir, run_script
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import common
from rlvr_utils import rollouts, tasks


def both_engines(model, tok, *args, seed=3, **kwargs):
    """generate_rollouts under --engine hf and under the static decoder, from the same seed."""
    out = []
    for hf in (True, False):
        model._rlvr_hf_generate = hf
        torch.manual_seed(seed)
        out.append(common.generate_rollouts(model, tok, *args, **kwargs))
    model._rlvr_hf_generate = False
    return out


def test_greedy_eval_and_sampled_rollouts_are_generates_tokens_bitwise(tiny):
    model, tok = tiny
    task = tasks.load_task("arith", tok, seed=1, num_eval=200)
    prompts = [e.prompt_ids for e in task.eval]
    hf, static = both_engines(model, tok, prompts, list(range(200)), 1, 48, temperature=1e-5, do_sample=False)
    assert torch.equal(hf.completion_ids, static.completion_ids) and hf.texts == static.texts
    train = [e.prompt_ids for e in task.train[:8]]
    for temperature, top_p, top_k in ((1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.9, 0), (1.2, 1.0, 5)):
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        hf, static = both_engines(model, tok, train, list(range(8)), 8, 48, **sampling)
        assert torch.equal(hf.completion_ids, static.completion_ids), sampling
        assert torch.equal(hf.completion_mask, static.completion_mask) and torch.equal(hf.truncated, static.truncated)


def small(config_class, dtype=torch.float32, **kw):
    base = dict(vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                bos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_class(**(base | kw))).to(dtype).eval()


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
FAMILY = {
    "llama": (LlamaConfig, {}),
    "llama3-rope-scaling": (LlamaConfig, {"rope_scaling": LLAMA3_ROPE}),
    "qwen2-gqa-bias": (Qwen2Config, {}),
    "qwen3-qk-norm": (Qwen3Config, {"head_dim": 16}),
    "mistral": (MistralConfig, {"sliding_window": None}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(FAMILY))
def test_llama_family_models_decode_as_generate(name, dtype):
    config_class, kw = FAMILY[name]
    model = small(config_class, dtype, **kw)
    assert rollouts.unsupported(model) is None
    g = torch.Generator().manual_seed(1)
    padded = rollouts.pad_left([torch.randint(2, 99, (int(n),), generator=g).tolist() for n in range(3, 19)], 0)
    same_length = (torch.randint(2, 99, (8, 6), generator=g), torch.ones(8, 6, dtype=torch.long))
    dec = rollouts.StaticDecoder(model)
    for ids, mask in (padded, same_length):
        for do_sample in (False, True):
            torch.manual_seed(4)
            ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=do_sample,
                                 temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=[1])  # fmt: skip
            torch.manual_seed(4)
            ours, _ = dec.generate(ids, mask, 30, 1.0, 1.0, 0, do_sample, [1], 0)
            assert torch.equal(ref[:, ids.shape[1] :], ours), (name, dtype, do_sample)


def test_sampled_log_probs_are_a_fresh_forwards(tiny):
    model, tok = tiny
    task = tasks.load_task("arith", tok, seed=2, num_eval=8)
    for temperature in (1.0, 0.7):
        torch.manual_seed(0)
        ro = common.generate_rollouts(model, tok, [e.prompt_ids for e in task.train[:4]], list(range(4)), 8, 48,
                                      temperature=temperature)  # fmt: skip
        T = ro.completion_ids.shape[1]
        logp, _ = common.token_logprobs(model, ro.input_ids, ro.attention_mask, T, temperature)
        m = ro.completion_mask.bool()
        assert (logp[m] - ro.sample_logp[m]).abs().max() < 1e-5
        assert (ro.sample_logp[~m] == 0).all()


def chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of the chi-square test that two count vectors come from one distribution (bins with no count dropped;
    bins under 5 expected pooled)."""
    keep = (a + b) > 0
    a, b = a[keep].double(), b[keep].double()
    order = torch.argsort(a + b, descending=True)
    a, b = a[order], b[order]
    n_a, n_b = a.sum(), b.sum()
    expected_a = (a + b) * n_a / (n_a + n_b)
    small_bins = expected_a < 5
    if small_bins.any():
        a = torch.cat([a[~small_bins], a[small_bins].sum(0, keepdim=True)])
        b = torch.cat([b[~small_bins], b[small_bins].sum(0, keepdim=True)])
    ea, eb = (a + b) * n_a / (n_a + n_b), (a + b) * n_b / (n_a + n_b)
    stat = (((a - ea) ** 2 / ea) + ((b - eb) ** 2 / eb)).sum()
    dof = len(a) - 1
    if dof == 0:  # one token only, in both: nothing to tell apart
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def test_sampled_tokens_have_generates_distribution_from_independent_seeds(tiny):
    """Not the same stream: 512 completions of one prompt from each engine at temperature 1.5 (the tiny policy is
    near-deterministic at 1), different seeds; per position, the token counts of the two samplers pass a chi-square
    test (and a deliberately hotter sampler does not)."""
    model, tok = tiny
    task = tasks.load_task("arith", tok, seed=3, num_eval=8)
    prompt = [task.train[0].prompt_ids]
    counts = {}
    for name, hf, seed, temperature in (("hf", True, 11, 1.5), ("static", False, 12, 1.5), ("hot", False, 13, 2.5)):
        model._rlvr_hf_generate = hf
        torch.manual_seed(seed)
        ro = common.generate_rollouts(model, tok, prompt, [0], 512, 16, temperature=temperature)
        counts[name] = [torch.bincount(ro.completion_ids[:, t], minlength=len(tok)) for t in range(16)]
    model._rlvr_hf_generate = False
    p_same = [chi_square_p(a, b) for a, b in zip(counts["hf"], counts["static"])]
    p_hot = [chi_square_p(a, b) for a, b in zip(counts["hf"], counts["hot"])]
    assert sum((c > 0).sum() > 2 for c in counts["hf"]) >= 3  # positions where the sampler has a choice
    assert min(p_same) > 1e-3, p_same
    assert min(p_hot) < 1e-3, p_hot  # the test can fail


def test_the_cuda_graphs_whole_cache_arithmetic_gives_the_same_tokens(tiny):
    """On a GPU each token's forward is a CUDA graph reading the whole cache under a -inf mask; the same forward runs
    eagerly on CPU here (whole_cache), greedy over 200 held-out prompts and sampled."""
    model, tok = tiny
    task = tasks.load_task("arith", tok, seed=1, num_eval=200)
    prompts = [e.prompt_ids for e in task.eval]
    eager = common.generate_rollouts(model, tok, prompts, list(range(200)), 1, 48, temperature=1e-5, do_sample=False)
    rollouts.static_decoder(model).whole_cache = True
    try:
        whole = common.generate_rollouts(model, tok, prompts, list(range(200)), 1, 48, temperature=1e-5,
                                         do_sample=False)  # fmt: skip
        torch.manual_seed(5)
        sampled = common.generate_rollouts(model, tok, prompts[:8], list(range(8)), 8, 48)
    finally:
        rollouts.static_decoder(model).whole_cache = False
    assert torch.equal(eager.completion_ids, whole.completion_ids)
    T = sampled.completion_ids.shape[1]
    logp, _ = common.token_logprobs(model, sampled.input_ids, sampled.attention_mask, T, 1.0)
    m = sampled.completion_mask.bool()
    assert ((logp[m] - sampled.sample_logp[m]).abs() / (1 + logp[m].abs())).max() < 1e-5  # relative: a longer sum


def test_a_failed_cuda_graph_capture_leaves_the_decoder_eager_and_says_so(tiny):
    """On CPU a capture fails (no CUDA): one warning, the decoder stays eager, the tokens are the eager ones."""
    model, tok = tiny
    task = tasks.load_task("arith", tok, seed=1, num_eval=16)
    prompts = [e.prompt_ids for e in task.eval]
    eager = common.generate_rollouts(model, tok, prompts, list(range(16)), 1, 48, temperature=1e-5, do_sample=False)
    rollouts.static_decoder(model).use_graphs = True
    with pytest.warns(UserWarning, match="no CUDA graph"):
        again = common.generate_rollouts(model, tok, prompts, list(range(16)), 1, 48, temperature=1e-5,
                                         do_sample=False)  # fmt: skip
    assert rollouts.static_decoder(model).use_graphs is False
    assert torch.equal(eager.completion_ids, again.completion_ids)


def test_lora_decodes_merged_copies_and_never_writes_the_base(tiny):
    """Under LoRA the loop reads W + s B A from copies of its own: the tokens are PEFT's (adapters on, greedy), they
    follow the adapters after an optimizer step, and the base weights stay bitwise what they were."""
    from types import SimpleNamespace

    from rlvr_utils import lora

    model = common.load_model(common.DEFAULT_MODEL, torch.device("cpu"))
    tok = common.load_tokenizer(common.DEFAULT_MODEL)
    flags = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules=())
    peft_model = lora.wrap(model, SimpleNamespace(**flags))
    base = {k: v.clone() for k, v in peft_model.get_base_model().state_dict().items() if "lora_" not in k}
    task = tasks.load_task("arith", tok, seed=1, num_eval=64)
    prompts = [e.prompt_ids for e in task.eval]
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.05)
    for step in range(3):
        hf, static = both_engines(peft_model, tok, prompts, list(range(64)), 1, 32, temperature=1e-5, do_sample=False)
        assert torch.equal(hf.completion_ids, static.completion_ids), step
        ro = common.generate_rollouts(peft_model, tok, prompts[:8], list(range(8)), 4, 32)  # an update on them
        T = ro.completion_ids.shape[1]
        logp, _ = common.token_logprobs(peft_model, ro.input_ids, ro.attention_mask, T)
        (-(logp * ro.completion_mask).sum()).backward()
        opt.step()
        opt.zero_grad()
    assert any(p.abs().sum() > 0 for n, p in peft_model.named_parameters() if "lora_B" in n)  # the adapters moved
    after = peft_model.get_base_model().state_dict()
    assert all(torch.equal(v, after[k]) for k, v in base.items())


class LiveTensors(TorchDispatchMode):
    """Counts the tensors every op made while the mode is on that are still alive; `peak`: the largest count."""

    def __init__(self):
        super().__init__()
        self.refs, self.peak = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs = [r for r in self.refs if r() is not None]
        self.refs += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.peak = max(self.peak, len(self.refs))
        return out


def test_the_decode_loop_keeps_no_tensor_per_token():
    """What the loop holds does not grow with the tokens: each token and log-prob goes into a [B, T] buffer. Kept as
    one small tensor per token, they sit inside the step's freed [B, V] temporaries on CPU, which glibc then neither
    reuses nor returns: after an update, about one [B, V] fp32 block of resident memory per token
    (benchmarks/script_memory.py, docs/benchmarks.md). The tensors alive at once, counted op by op, at 8 and 40 new
    tokens."""
    model = small(Qwen2Config, vocab_size=499)
    dec = rollouts.StaticDecoder(model)
    ids, mask = torch.randint(2, 499, (8, 6), generator=torch.Generator().manual_seed(2)), torch.ones(8, 6).long()
    peaks = []
    for T in (8, 40):
        torch.manual_seed(0)
        with LiveTensors() as live:
            out, logp = dec.generate(ids, mask, T, 1.0, 1.0, 0, True, [1], 0)
        assert out.shape == logp.shape == (8, T)  # no early stop: every step ran
        peaks.append(live.peak)
    assert peaks[1] - peaks[0] <= 4, peaks


def test_a_model_outside_the_llama_family_samples_with_generate(capsys):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=64, eos_token_id=1, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert "gpt2" in rollouts.unsupported(model)
    assert rollouts.static_decoder(model) is None
    assert "does not handle model type gpt2" in capsys.readouterr().err


def normalized(rows: list[dict]) -> list[dict]:
    drop = ("time/", "tokens_per_second", "memory/")
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


@pytest.mark.parametrize("script", ["grpo.py", "srpo.py"])  # srpo.py: localization, suffixes; the others: grpo.py's
def test_every_generate_call_of_a_run_is_the_same_under_engine_hf(script, tmp_path):
    """Every evaluation (greedy) and every training step: metrics.jsonl under the static decoder equals --engine hf's,
    value for value (the sampler's random stream is generate's). sc_grpo.py, grpo_lambda.py and ep_grpo.py sample
    through grpo.py's one call (common.rollouts_with_rewards); srpo.py adds its own (localization, the suffixes)."""
    name, *extra = script.split()
    flags = ["--total-steps", "2", "--eval-every", "1", "--num-eval", "24", "--prompts-per-step", "4",
             "--num-generations", "4", *extra]  # fmt: skip
    runs = {}
    for engine in ("hf", "static"):
        out = tmp_path / engine
        r = run_script(name, *flags, "--engine", engine, "--output-dir", str(out))
        assert r.returncode == 0, r.stderr[-2000:]
        runs[engine] = normalized([json.loads(line) for line in (run_dir(out) / "metrics.jsonl").open()])
    assert len(runs["hf"]) == 3 and all(math.isfinite(r["eval/accuracy"]) for r in runs["hf"] if "eval/accuracy" in r)
    assert runs["hf"] == runs["static"]
