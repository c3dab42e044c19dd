"""The static decoder's token step as a CUDA graph (rollouts.StaticDecoder on a GPU; imported only there).

A decode step is a few hundred small kernels (28 layers x ~15 ops for a 1.5B model), each launched from Python: at RL
batch sizes the GPU waits on the launches, not on the weights. Captured once per batch size and cache length, the step
replays as one launch. A graph needs fixed shapes and addresses, so its step reads the whole cache under an additive
mask (-inf where a row does not attend) and takes the cache slot as a tensor; the weights it reads are the model's
parameters (updated in place by the optimizer) and the decoder's refreshed-in-place copies. Each capture is checked
once against the same step run eagerly; a capture that fails or disagrees leaves the decoder eager, said once.
`capture=False` runs the same whole-cache arithmetic eagerly (how tests/test_decode.py checks it on CPU).
"""

from __future__ import annotations

import warnings

import torch

GRAPHS = 4  # graphs kept per decoder (one per batch size and cache length); the oldest is dropped


def decode_step(decoder, w, B: int, L: int, dtype, capture: bool = True):
    """(step, kv, bias) for B rows and a cache of L slots: step(tok [B], cos, sin [B, 1, D], slot: int) -> logits
    [B, V], reading and writing kv [layers, 2, B, Hkv, L, D] under the additive mask bias [B, 1, 1, L] that the
    caller fills. Captured as a CUDA graph when `capture` (kept on the decoder for the next call of this shape)."""
    if capture and (B, L) in decoder.graphs:
        return decoder.graphs[(B, L)]
    device = next(decoder.lm.parameters()).device
    kv = torch.zeros(len(w), 2, B, decoder.Hkv, L, decoder.D, dtype=dtype, device=device)  # finite: 0 x NaN is NaN
    bias = torch.zeros(B, 1, 1, L, dtype=dtype, device=device)
    tok = torch.zeros(B, dtype=torch.long, device=device)
    slot = torch.zeros(1, dtype=torch.long, device=device)
    cos = torch.zeros(B, 1, decoder.D, dtype=dtype, device=device)
    sin = torch.zeros_like(cos)

    def forward():
        return decoder.forward(w, kv, tok, cos, sin, slot, bias)

    def load(t, c, s, at):  # this step's inputs into the graph's own tensors
        tok.copy_(t)
        cos.copy_(c)
        sin.copy_(s)
        slot.fill_(at)

    def eager(*inputs):
        load(*inputs)
        return forward()

    if not capture:
        return eager, kv, bias
    graph, out = capture_graph(forward)
    if graph is None:
        decoder.use_graphs = False
        return eager, kv, bias

    def replay(*inputs):
        load(*inputs)
        graph.replay()
        return out

    while len(decoder.graphs) >= GRAPHS:
        decoder.graphs.pop(next(iter(decoder.graphs)))
    decoder.graphs[(B, L)] = (replay, kv, bias)
    return decoder.graphs[(B, L)]


def capture_graph(forward):
    """(graph, its output) of `forward` after two warm-up calls on a side stream (PyTorch's recipe), or (None, None)
    with a warning when capture fails or a replay disagrees with an eager call (on zero inputs: the warm-up writes
    slot 0 of the cache, which the prompt's copy overwrites afterwards)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward()
        graph.replay()
        want = forward().float()
        ok = torch.allclose(out.float(), want, rtol=0.02, atol=0.02 * float(want.abs().max()) + 1e-6)
        why = "a replay disagrees with the eager step"
    except Exception as e:  # noqa: BLE001 (any failure to capture: the step stays eager)
        ok, why = False, str(e).splitlines()[0] if str(e) else type(e).__name__
    if not ok:
        warnings.warn(f"static decoder: no CUDA graph ({why}); decoding eagerly", stacklevel=3)
        return None, None
    return graph, out
