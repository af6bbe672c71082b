"""The attention arithmetic of the CPU core attention (models/attention_ops.py) against
transformers' own: its sliding-window mask function and gpt-oss's eager attention with sinks."""
from __future__ import annotations

import types

import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from mcore_rl.models.attention_ops import allowed_pairs, attend, causal_window


@pytest.mark.parametrize("window", [1, 2, 3, 5, 8, 40])
def test_window_mask_is_transformers_sliding_window(window):
    s = 11
    hf_mask = sliding_window_causal_mask_function(window)
    zero = torch.tensor(0)
    ref = hf_mask(zero, zero, torch.arange(s)[:, None], torch.arange(s)[None, :]).expand(s, s)
    assert torch.equal(causal_window(s, s, window - 1, None), ref)
    # the last s_q queries of s positions (the rows of a longer square)
    assert torch.equal(causal_window(4, s, window - 1, None), ref[-4:])
    # by position, in any key order (context parallelism gathers keys out of order)
    perm = torch.randperm(s, generator=torch.Generator().manual_seed(window))
    assert torch.equal(allowed_pairs(torch.arange(s), perm, window - 1), ref[:, perm])


def _hf_sink_attention(q, k, v, allowed, scale, sink):
    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sink, training=False)
    additive = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
    out, _ = eager_attention_forward(module, q, k, v, additive, scale)
    return out.transpose(1, 2)  # HF returns [b, s, heads, d]


@pytest.mark.parametrize("window,seed", [(None, 0), (3, 1), (6, 2)])
def test_sink_attention_equals_gpt_oss_eager(window, seed):
    """Forward and every gradient (queries, keys, values, sinks) in float64, GQA, with left
    padding on one row, equal to transformers' gpt-oss eager attention."""
    g = torch.Generator().manual_seed(seed)
    b, heads, groups, s, d = 2, 4, 2, 9, 8
    q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, groups, s, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sink = (2 * torch.randn(heads, generator=g, dtype=torch.float64)).requires_grad_()
    allowed = causal_window(s, s, None if window is None else window - 1, None)[None, None].repeat(b, 1, 1, 1)
    allowed[1, :, :, :3] = False  # row 1: three padding keys
    allowed[1, :, :3, :3] |= torch.eye(3, dtype=torch.bool)  # a padding query sees itself
    ref = _hf_sink_attention(q, k, v, allowed, 0.3, sink)
    ours = attend(q, k, v, allowed, 0.3, 0.0, sink)
    assert (ours - ref).abs().max() <= 1e-12
    weights = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    grads_ref = torch.autograd.grad((ref * weights).sum(), (q, k, v, sink))
    grads = torch.autograd.grad((ours * weights).sum(), (q, k, v, sink))
    for name, a, r in zip("qkvs", grads, grads_ref):
        assert (a - r).abs().max() <= 1e-12, name
    assert grads[3].abs().min() > 1e-3  # the sinks take part
    # without the sink the result differs: the mechanism is active
    assert (attend(q, k, v, allowed, 0.3, 0.0) - ref).abs().max() > 1e-2
