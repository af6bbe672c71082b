"""Torch kernels of Gated DeltaNet (GDN) layers, for CPUs and GPUs without flash-linear-attention.

megatron-core's ``GatedDeltaNet`` calls flash-linear-attention's (FLA, Triton) ``l2norm`` and
``chunk_gated_delta_rule`` and, when installed, the ``causal_conv1d`` package's
``causal_conv1d_fn``. These functions have the same arguments and results, in plain torch
(differentiable through autograd); the platform installs them where megatron looks for the real
ones (fix ``gdn_torch_kernels``, applied by :mod:`mcore_rl.platform.hybrid_fixes`).

The gated delta rule, per sequence and head (state S: [K, V], q_t and k_t: [K], v_t: [V])::

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
    o_t = scale * S_t^T q_t

computed in chunks of ``chunk_size`` tokens: within a chunk the deltas u solve one unit lower
triangular system, and only the state crosses chunks (a Python loop per chunk, not per token).
Packed sequences (``cu_seqlens``) each start on a chunk of their own, so the state restarts
exactly at every sequence start, wherever it falls in the stream.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mcore_rl.errors import McoreRLError


class GDNKernelError(McoreRLError, ValueError):
    """The arguments of a GDN kernel do not fit together (shapes, cu_seqlens, activation)."""


def l2norm(x: Tensor, dim: int = -1, eps: float = 1e-6) -> Tensor:
    """``x * rsqrt(sum(x * x, dim) + eps)`` (FLA's and transformers' formula), computed in at
    least fp32 and returned in x's dtype. x: any shape."""
    acc = x.to(torch.promote_types(x.dtype, torch.float32))
    return (acc * torch.rsqrt((acc * acc).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def _check_rule_args(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> None:
    if q.dim() != 4 or q.shape != k.shape:
        raise GDNKernelError(
            f"chunk_gated_delta_rule: q {tuple(q.shape)} and k {tuple(k.shape)} must both be "
            "[B, T, H, K]; pass tensors in the [batch, time, heads, dim] layout."
        )
    b, t, h, _ = q.shape
    if v.dim() != 4 or v.shape[:2] != (b, t) or v.shape[2] % h:
        raise GDNKernelError(
            f"chunk_gated_delta_rule: v {tuple(v.shape)} must be [B, T, HV, V] with B, T of q "
            f"{tuple(q.shape)} and HV a multiple of its {h} heads."
        )
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != tuple(v.shape[:3]):
            raise GDNKernelError(
                f"chunk_gated_delta_rule: {name} {tuple(x.shape)} must be [B, T, HV] = "
                f"{tuple(v.shape[:3])} (one value per token and value head)."
            )


def _sequence_lengths(cu_seqlens: Tensor | None, batch: int, length: int) -> list[int]:
    """Per-sequence token counts: the rows of the batch, or the cu_seqlens segments of one row."""
    if cu_seqlens is None:
        return [length] * batch
    bounds = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else []
    if batch != 1:
        raise GDNKernelError(
            f"chunk_gated_delta_rule: cu_seqlens needs batch size 1, got {batch}; flatten the "
            "packed sequences into one row [1, total_tokens, ...]."
        )
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if not lengths or bounds[0] != 0 or bounds[-1] != length or min(lengths) < 0:
        raise GDNKernelError(
            f"chunk_gated_delta_rule: cu_seqlens {bounds} must rise from 0 to the {length} tokens "
            "of the stream ([N+1] sequence boundaries)."
        )
    return lengths


def _to_chunk_stream(x: Tensor, lengths: list[int], chunk: int) -> Tensor:
    """[R, T, ...] -> [R, n_chunks * chunk, ...] with each sequence starting on a chunk of its
    own and zeros after its end. Rows (cu_seqlens None) pad at their end; a packed row
    (R == 1, several lengths) moves every sequence to its own chunks."""
    if len(lengths) == x.shape[0]:  # one sequence per row
        pad = -x.shape[1] % chunk
        return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
    dest = _stream_positions(lengths, chunk, x.device)
    n_out = sum(-(-n // chunk) for n in lengths) * chunk
    out = x.new_zeros((1, n_out, *x.shape[2:]))
    return out.index_copy(1, dest, x)


def _stream_positions(lengths: list[int], chunk: int, device: torch.device) -> Tensor:
    """Where each packed token lands in the chunk-aligned stream: [T] int64 on ``device``."""
    counts = torch.tensor(lengths, dtype=torch.long, device=device)
    n_chunks = -(-counts // chunk)
    chunk_starts = torch.cumsum(n_chunks, 0) - n_chunks
    seq_starts = torch.cumsum(counts, 0) - counts
    seq_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
    token = torch.arange(sum(lengths), device=device)
    return token - seq_starts[seq_of_token] + chunk_starts[seq_of_token] * chunk


def _intra_chunk(q, k, v, g, beta):
    """The per-chunk quantities (all chunks at once) of inputs [R, H, NC, C, *] (g, beta
    [R, H, NC, C]): the in-chunk decay products and the solved delta system, see module doc."""
    c = g.shape[-1]
    # G_r: log decay from the chunk start to position r (inclusive), summed in float64: the
    # differences G_r - G_s of sums reaching -1e3 lose ~1e-4 in fp32, and a packed stream and
    # a padded row align chunks differently (fp32 sums put 3e-5 between their logits)
    gc = g.double().cumsum(-1)
    later = torch.ones(c, c, dtype=torch.bool, device=g.device).triu(1)
    # D[r, s] = exp(G_r - G_s) for s <= r (<= 1 for g <= 0), 0 above the diagonal
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(later, float("-inf")).exp().to(g.dtype)
    # (I + A) u = beta v - beta exp(G) k S0, A[r, s] = beta_r D[r, s] k_r.k_s for s < r
    strictly_lower = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = strictly_lower + torch.eye(c, dtype=g.dtype, device=g.device)
    u0 = torch.linalg.solve_triangular(system, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, (beta * gc.exp().to(g.dtype)).unsqueeze(-1) * k, upper=False, unitriangular=True
    )
    qk = (q @ k.transpose(-1, -2)) * decay  # causal in-chunk scores, scale already in q
    q_decayed = q * gc.exp().to(g.dtype).unsqueeze(-1)
    k_to_end = k * (gc[..., -1:] - gc).exp().to(g.dtype).unsqueeze(-1)
    chunk_decay = gc[..., -1].exp().to(g.dtype)[..., None, None]
    return u0, w, qk, q_decayed, k_to_end, chunk_decay


def _scan_chunks(parts, starts: dict[int, Tensor], ends: set[int]) -> tuple[Tensor, dict[int, Tensor]]:
    """Carries the state [R, H, K, V] across the chunks: ``starts[j]`` replaces it before chunk
    j (a sequence start), the state after each chunk in ``ends`` is kept. Returns the outputs
    [R, H, NC, C, V] and {chunk: state after it}."""
    # unbind once: indexing [:, :, j] in the loop would cost a full-size zero gradient per chunk
    u0, w, qk, q_decayed, k_to_end, chunk_decay = (x.unbind(2) for x in parts)
    outs, kept, state = [], {}, None
    for j in range(len(u0)):
        state = starts.get(j, state)
        delta = u0[j] - w[j] @ state  # u of every token of the chunk: [R, H, C, V]
        outs.append(q_decayed[j] @ state + qk[j] @ delta)
        state = state * chunk_decay[j] + k_to_end[j].transpose(-1, -2) @ delta
        if j in ends:
            kept[j] = state
    return torch.stack(outs, dim=2), kept


def _chunked(x: Tensor, lengths: list[int], chunk: int) -> Tensor:
    """[R, T, H, *] -> [R, H, NC, C, *] on the chunk-aligned stream."""
    x = _to_chunk_stream(x, lengths, chunk)
    r, t = x.shape[:2]
    x = x.reshape(r, t // chunk, chunk, *x.shape[2:])
    return x.permute(0, 3, 1, 2, 4) if x.dim() == 5 else x.permute(0, 3, 1, 2)


def _state_plan(lengths: list[int], rows: int, chunk: int, h0: Tensor):
    """Where the state restarts and where each sequence's final state is read. Returns
    (starts {chunk: [R, H, K, V]}, ends {sequence: chunk or None for an empty sequence})."""
    if len(lengths) == rows:  # one sequence per row: all rows start at chunk 0
        last = -(-lengths[0] // chunk) - 1 if lengths else -1
        return {0: h0}, {i: (last if last >= 0 else None) for i in range(rows)}
    starts, ends, first = {}, {}, 0
    for i, n in enumerate(lengths):
        n_chunks = -(-n // chunk)
        if n_chunks:
            starts[first] = h0[i : i + 1]
        ends[i] = first + n_chunks - 1 if n_chunks else None
        first += n_chunks
    return starts, ends


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule (module doc) with flash-linear-attention's arguments.

    q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H: consecutive value heads share a
    query/key head); g (log decay, <= 0) and beta: [B, T, HV]; scale defaults to K**-0.5;
    initial_state: [N, HV, K, V] or None (zeros); cu_seqlens: [N+1] boundaries of N packed
    sequences in a batch of one row (else N = B). Computed in fp32 (fp64 for fp64 inputs).
    Returns o [B, T, HV, V] in v's dtype and, if ``output_final_state``, the final states
    [N, HV, K, V] in the computation dtype (None otherwise).
    """
    _check_rule_args(q, k, v, g, beta)
    if chunk_size < 1:
        raise GDNKernelError(f"chunk_gated_delta_rule: chunk_size={chunk_size}; use a positive size (64).")
    batch, length, heads, dim_k = q.shape
    v_heads, dim_v = v.shape[2:]
    lengths = _sequence_lengths(cu_seqlens, batch, length)
    acc = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    out_dtype = v.dtype
    h0 = _initial_state(initial_state, len(lengths), (v_heads, dim_k, dim_v), acc, q.device)
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if v_heads != heads:
        q, k = (x.repeat_interleave(v_heads // heads, dim=2) for x in (q, k))
    q = q * (dim_k**-0.5 if scale is None else scale)
    if length == 0:
        return v.new_zeros(v.shape, dtype=out_dtype), (h0 if output_final_state else None)
    chunked = [_chunked(x, lengths, chunk_size) for x in (q, k, v, g, beta)]
    starts, ends = _state_plan(lengths, batch, chunk_size, h0)
    out, kept = _scan_chunks(_intra_chunk(*chunked), starts, set(e for e in ends.values() if e is not None))
    out = out.permute(0, 2, 3, 1, 4).reshape(out.shape[0], -1, v_heads, dim_v)  # [R, T', HV, V]
    if cu_seqlens is None:
        out = out[:, :length]
    else:
        out = out.index_select(1, _stream_positions(lengths, chunk_size, out.device))
    final = None
    if output_final_state:
        final = _final_states(kept, ends, h0, rows_are_sequences=cu_seqlens is None)
    return out.to(out_dtype), final


def _initial_state(initial_state: Tensor | None, n: int, shape: tuple, acc, device) -> Tensor:
    """The initial states [N, HV, K, V] in the computation dtype (zeros when None)."""
    if initial_state is None:
        return torch.zeros((n, *shape), dtype=acc, device=device)
    if tuple(initial_state.shape) != (n, *shape):
        raise GDNKernelError(
            f"chunk_gated_delta_rule: initial_state {tuple(initial_state.shape)} must be "
            f"[N, HV, K, V] = {(n, *shape)}: one state per sequence (batch row, or cu_seqlens "
            "segment)."
        )
    return initial_state.to(acc)


def _final_states(kept: dict[int, Tensor], ends: dict, h0: Tensor, rows_are_sequences: bool) -> Tensor:
    """[N, HV, K, V]: each sequence's state after its last chunk (its initial state if empty)."""
    if rows_are_sequences:
        last = next(iter(ends.values()))
        return h0 if last is None else kept[last]
    return torch.stack([h0[i] if j is None else kept[j][0] for i, j in sorted(ends.items())])


def causal_conv1d_fn(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    seq_idx: Tensor | None = None,
    activation: str | None = None,
) -> Tensor:
    """Depthwise causal convolution with the ``causal_conv1d`` package's arguments.

    x: [B, D, T]; weight: [D, W]; bias: [D] or None; ``out[:, :, t] = bias + sum_j weight[:, j]
    * x[:, :, t - W + 1 + j]`` with zeros before the start; seq_idx [B, T] (int): a tap reads
    only tokens of the same sequence as t (the window restarts where seq_idx changes);
    activation None, "silu" or "swish". Returns [B, D, T] in x's dtype. One vectorised term per
    tap (W of them), summed in tap order, with or without seq_idx.
    """
    if activation not in (None, "silu", "swish"):
        raise GDNKernelError(f"causal_conv1d_fn: activation={activation!r}; use None, 'silu' or 'swish'.")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise GDNKernelError(
            f"causal_conv1d_fn: x {tuple(x.shape)} must be [B, D, T] and weight "
            f"{tuple(weight.shape)} [D, W] with the same D (depthwise filters)."
        )
    if seq_idx is not None and tuple(seq_idx.shape) != (x.shape[0], x.shape[2]):
        raise GDNKernelError(
            f"causal_conv1d_fn: seq_idx {tuple(seq_idx.shape)} must be [B, T] = "
            f"{(x.shape[0], x.shape[2])}: one sequence index per token."
        )
    width, length = weight.shape[1], x.shape[2]
    out = None
    for j in range(width):
        shift = width - 1 - j  # this tap reads the token `shift` steps back
        if shift >= length:
            continue
        tap = F.pad(x[..., : length - shift], (shift, 0))
        if seq_idx is not None and shift:
            same = F.pad(seq_idx[:, : length - shift], (shift, 0), value=-1) == seq_idx
            tap = torch.where(same.unsqueeze(1), tap, torch.zeros((), dtype=tap.dtype, device=tap.device))
        term = tap * weight[:, j].unsqueeze(-1)
        out = term if out is None else out + term
    if out is None:
        out = torch.zeros_like(x)
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    return F.silu(out) if activation is not None else out

