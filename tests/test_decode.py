"""The static decoder (rlvr_utils/core/rollouts.StaticDecoder, the default engine) against transformers' `generate`: the
same tokens bitwise (greedy and sampled from one seed, fp32 and bf16, eight Llama-family configurations with random
norms and biases, two stop ids), the same distribution from independent seeds, log-probs equal to a fresh forward's,
the CUDA graph's whole-cache arithmetic, LoRA decoded from merged copies without touching the base, a sliding window
the sequence outgrows sampled with `generate`, `--engine hf` sampling with the run's flags alone whatever the
checkpoint's generation_config.json sets, and a run identical under --engine hf."""

import json
import math
import shutil
import weakref

import pytest
import torch
from helpers import run_dir, run_script
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import common
from rlvr_utils.core import models, rollouts, tasks


@pytest.fixture(autouse=True, scope="module")
def one_thread(tiny):
    """One torch thread in this file (after the tiny fixture's two): its decodes are many small ops, and two threads on
    a loaded 2-core machine wait for each other at every one. Measured on this file's fast set, load ~8, one run after
    the other: 105 s and 134 s with one thread, 718 s with two. Comparisons within the process are unchanged."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    task = tasks.load_task("arith", tok, seed=1, num_eval=48)
    prompts = [e.prompt_ids for e in task.eval]
    hf, static = both_engines(model, tok, prompts, list(range(48)), 1, 48, temperature=1e-5, do_sample=False)
    assert torch.equal(hf.completion_ids, static.completion_ids) and hf.texts == static.texts
    train = [e.prompt_ids for e in task.train[:4]]
    for temperature, top_p, top_k in ((1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.9, 0), (1.2, 1.0, 5)):
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        hf, static = both_engines(model, tok, train, list(range(4)), 8, 48, **sampling)
        assert torch.equal(hf.completion_ids, static.completion_ids), sampling
        assert torch.equal(hf.completion_mask, static.completion_mask) and torch.equal(hf.truncated, static.truncated)


def small(config_class, dtype=torch.float32, **kw):
    """A random two-layer model of `config_class` whose norm weights and biases are random too, as a checkpoint's are
    (ones and zeros would hide a norm or a bias read from the wrong module)."""
    base = dict(vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                bos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_class(**(base | kw)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm weights (input, post-attention, q_norm, k_norm, final) and biases
                p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


def stop_pair(dec, ids, mask) -> list[int]:
    """Two stop ids [a, b] for these prompts: b is row 0's third greedy token, a the third token of a row that writes
    no b before it, and row 0 no a before its b: row 0 stops on b, the second id (a rule that tests the first id only
    shows), that row on a."""
    toks, _ = dec.generate(ids, mask, 30, 1.0, 1.0, 0, False, [-1], 0)  # greedy, never stopped
    b = int(toks[0, 2])
    a = next(int(row[2]) for row in toks[1:] if b not in row[:3] and row[2] not in toks[0, :3])
    return [a, b]


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
QWEN2_WINDOW = {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}  # layer 1 windowed
FAMILY = {
    "llama": (LlamaConfig, {}),
    "llama3-rope-scaling": (LlamaConfig, {"rope_scaling": LLAMA3_ROPE}),
    "llama-dynamic-ntk": (LlamaConfig, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),  # within 256
    "qwen2-gqa-bias": (Qwen2Config, {}),
    "qwen2-window-64-layer-1": (Qwen2Config, QWEN2_WINDOW),  # the sequences (<= 48) fit the window
    "qwen3-qk-norm": (Qwen3Config, {"head_dim": 16}),
    "mistral": (MistralConfig, {"sliding_window": None}),
    "mistral-window-64": (MistralConfig, {"sliding_window": 64}),
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
    dec = rollouts.static_decoder(model, padded[0].shape[1] + 30)  # a window of 64: the loop decodes
    assert dec is not None
    for ids, mask in (padded, same_length):
        stops = stop_pair(dec, ids, mask)
        for do_sample in (False, True):
            torch.manual_seed(4)
            ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=do_sample,
                                 temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=stops)  # fmt: skip
            torch.manual_seed(4)
            ours, _ = dec.generate(ids, mask, 30, 1.0, 1.0, 0, do_sample, stops, 0)
            assert torch.equal(ref[:, ids.shape[1] :], ours), (name, dtype, do_sample)
            if not do_sample:  # row 0 stopped on the second id, some row on the first
                first = [next((t for t in row.tolist() if t in stops), None) for row in ours]
                assert first[0] == stops[1] and stops[0] in first, (name, stops, first)


WINDOWED = {  # a 6-token window, shorter than every prompt + 24 new tokens
    "mistral": (MistralConfig, {"sliding_window": 6}),
    "qwen2-layer-1": (Qwen2Config, QWEN2_WINDOW | {"sliding_window": 6}),
}


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_a_sliding_window_the_sequence_outgrows_samples_with_generate(name, tiny, capsys):
    """Past its window the loop's full attention is another model (its greedy tokens differ from generate's, shown
    first): with prompt + --max-new-tokens longer than the window the rollouts come from generate, which applies it,
    said once in one line, greedy and sampled the same tokens as --engine hf's."""
    _, tok = tiny
    config_class, kw = WINDOWED[name]
    model = small(config_class, **kw)
    assert models.attention_window(model.config) == 6 and rollouts.unsupported(model) is None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 99, (int(n),), generator=g).tolist() for n in range(3, 11)]
    ids, mask = rollouts.pad_left(prompts, 0)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                         eos_token_id=[1])  # fmt: skip
    full_attention, _ = rollouts.StaticDecoder(model).generate(ids, mask, 24, 1.0, 1.0, 0, False, [1], 0)
    assert not torch.equal(ref[:, ids.shape[1] :], full_attention)  # the window matters in this model
    hf, static = both_engines(model, tok, prompts, list(range(8)), 1, 24, do_sample=False)
    assert torch.equal(hf.completion_ids, static.completion_ids) and static.sample_logp is None
    P, m, attn = static.prompt_ids.shape[1], static.completion_mask.bool(), static.attention_mask
    with torch.no_grad():  # and they are the greedy tokens of a fresh forward (the loss's), window and all
        logits = model(input_ids=static.input_ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0))
    assert torch.equal(logits.logits[:, P - 1 : -1].argmax(-1)[m], static.completion_ids[m])
    hf, static = both_engines(model, tok, prompts, list(range(8)), 4, 24)
    assert torch.equal(hf.completion_ids, static.completion_ids) and static.sample_logp is None
    err = capsys.readouterr().err
    assert err.count("note: sampling with transformers' generate") == 1 and "6-token sliding window" in err, err


def test_rotary_frequencies_that_follow_the_length_bound_the_positions(tmp_path, monkeypatch, tiny):
    """Past the positions whose rotary frequencies are fixed (dynamic NTK past max_position_embeddings, longrope past
    its original length) transformers rescales them to each call's length, so a token decoded against a cache is not
    what a fresh forward of the whole sequence scores (shown: 40-token sequences of a dynamic-NTK model of 16
    positions, whose sampled log-probs are off by more than 1e-3, and within 256 positions equal to 1e-5).
    model_positions bounds a prompt + completion by those positions: a local config.json's and a hub id's cached
    one."""
    _, tok = tiny
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 99, (10,), generator=g).tolist() for _ in range(4)]
    for positions, worst in ((16, 1e-3), (256, 1e-5)):
        model = small(LlamaConfig, max_position_embeddings=positions, rope_scaling={"rope_type": "dynamic",
                                                                                    "factor": 4.0})  # fmt: skip
        torch.manual_seed(0)
        ro = common.generate_rollouts(model, tok, prompts, list(range(4)), 2, 30)
        logp, _ = common.token_logprobs(model, ro.input_ids, ro.attention_mask, ro.completion_ids.shape[1])
        m = ro.completion_mask.bool()
        gap = float((logp[m] - ro.sample_logp[m]).abs().max().detach())
        assert (gap > worst) if positions == 16 else (gap < worst), (positions, gap)
    rope = {"rope_type": "longrope", "original_max_position_embeddings": 64}
    for kind, extra, expected in (("plain", {}, 256), ("dynamic", {"rope_scaling": {"rope_type": "dynamic"}}, 256),
                                  ("longrope", {"rope_parameters": rope}, 64)):  # fmt: skip
        d = tmp_path / kind
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"max_position_embeddings": 256, **extra}))
        assert models.model_positions(str(d)) == expected, kind
    assert models.prompt_limit(str(tmp_path / "longrope"), 1024, 48) == 64 - 48
    snapshot = tmp_path / "hub" / "models--org--longrope" / "snapshots" / "abc123"  # the hub's cache layout
    shutil.copytree(tmp_path / "longrope", snapshot)
    (tmp_path / "hub" / "models--org--longrope" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--longrope" / "refs" / "main").write_text("abc123")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert models.model_positions("org/longrope") == 64 and models.model_positions("org/absent") is None


LEAKY = {"repetition_penalty": 1.5, "no_repeat_ngram_size": 3, "min_new_tokens": 8, "do_sample": True,
         "temperature": 0.7, "top_k": 2}  # fmt: skip  # Qwen2.5-Instruct ships repetition_penalty 1.05


def test_engine_hf_samples_with_the_run_flags_alone(tmp_path):
    """A checkpoint whose generation_config.json sets a repetition penalty, no_repeat_ngram_size, min_new_tokens and
    its own sampling: --engine hf draws the static decoder's tokens (it reads none of that), greedy and sampled, so
    the rollouts come from the distribution the loss scores; the checkpoint's config is still the model's after."""
    shutil.copytree(common.DEFAULT_MODEL, tmp_path / "m")
    path = tmp_path / "m" / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | LEAKY))
    model, tok = common.load_policy(str(tmp_path / "m"), torch.device("cpu"))
    task = tasks.load_task("arith", tok, seed=1, num_eval=16)
    prompts = [e.prompt_ids for e in task.eval]
    hf, static = both_engines(model, tok, prompts, list(range(16)), 1, 48, temperature=1e-5, do_sample=False)
    assert torch.equal(hf.completion_ids, static.completion_ids)
    hf, static = both_engines(model, tok, prompts[:4], list(range(4)), 4, 48)
    assert torch.equal(hf.completion_ids, static.completion_ids)
    assert {k: getattr(model.generation_config, k) for k in LEAKY} == LEAKY


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
    eagerly on CPU here (whole_cache), greedy over 48 held-out prompts and sampled."""
    model, tok = tiny
    task = tasks.load_task("arith", tok, seed=1, num_eval=48)
    prompts = [e.prompt_ids for e in task.eval]
    eager = common.generate_rollouts(model, tok, prompts, list(range(48)), 1, 48, temperature=1e-5, do_sample=False)
    rollouts.static_decoder(model).whole_cache = True
    try:
        whole = common.generate_rollouts(model, tok, prompts, list(range(48)), 1, 48, temperature=1e-5,
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
    task = tasks.load_task("arith", tok, seed=1, num_eval=8)
    prompts = [e.prompt_ids for e in task.eval]
    eager = common.generate_rollouts(model, tok, prompts, list(range(8)), 1, 24, temperature=1e-5, do_sample=False)
    rollouts.static_decoder(model).use_graphs = True
    with pytest.warns(UserWarning, match="no CUDA graph"):
        again = common.generate_rollouts(model, tok, prompts, list(range(8)), 1, 24, temperature=1e-5,
                                         do_sample=False)  # fmt: skip
    assert rollouts.static_decoder(model).use_graphs is False
    assert torch.equal(eager.completion_ids, again.completion_ids)


def test_lora_decodes_merged_copies_and_never_writes_the_base(tiny):
    """Under LoRA the loop reads W + s B A from copies of its own: the tokens are PEFT's (adapters on, greedy), they
    follow the adapters after an optimizer step, and the base weights stay bitwise what they were."""
    from types import SimpleNamespace

    from rlvr_utils.extras import lora

    model = common.load_model(common.DEFAULT_MODEL, torch.device("cpu"))
    tok = common.load_tokenizer(common.DEFAULT_MODEL)
    flags = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules=())
    peft_model = lora.wrap(model, SimpleNamespace(**flags))
    base = {k: v.clone() for k, v in peft_model.get_base_model().state_dict().items() if "lora_" not in k}
    task = tasks.load_task("arith", tok, seed=1, num_eval=16)
    prompts = [e.prompt_ids for e in task.eval]
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.05)
    for step in range(3):
        hf, static = both_engines(peft_model, tok, prompts, list(range(16)), 1, 32, temperature=1e-5, do_sample=False)
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


SRPO = pytest.param("srpo.py", marks=pytest.mark.slow)  # its own calls: localization, the suffixes


@pytest.mark.parametrize("script", ["grpo.py", SRPO])
def test_every_generate_call_of_a_run_is_the_same_under_engine_hf(script, tmp_path):
    """Every evaluation (greedy) and every training step: metrics.jsonl under the static decoder equals --engine hf's,
    value for value (the sampler's random stream is generate's). sc_grpo.py, grpo_lambda.py and ep_grpo.py sample
    through grpo.py's one call (common.rollouts_with_rewards); srpo.py adds its own (localization, the suffixes)."""
    name, *extra = script.split()
    flags = ["--total-steps", "2", "--eval-every", "1", "--num-eval", "8", "--prompts-per-step", "4",
             "--num-generations", "4", *extra]  # fmt: skip
    runs = {}
    for engine in ("hf", "static"):
        out = tmp_path / engine
        r = run_script(name, *flags, "--engine", engine, "--output-dir", str(out))
        assert r.returncode == 0, r.stderr[-2000:]
        runs[engine] = normalized([json.loads(line) for line in (run_dir(out) / "metrics.jsonl").open()])
    assert len(runs["hf"]) == 3 and all(math.isfinite(r["eval/accuracy"]) for r in runs["hf"] if "eval/accuracy" in r)
    assert runs["hf"] == runs["static"]
