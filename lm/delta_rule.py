"""The gated delta rule, in two equivalent forms (all maths in float32).

Per value head, with state `S [Dk, Dv]`, for each token (q, k unit-norm, q scaled by Dk^-1/2):
    S <- exp(g) * S
    S <- S + k (beta * (v - S^T k))^T        # delta rule: write only what S does not already predict
    o  = S^T q
`recurrent_gated_delta_rule` runs this token by token (decode). `chunked_gated_delta_rule` computes
the same thing chunk by chunk with the WY/UT transform (prefill): within a chunk the sequential
updates collapse into a unit lower-triangular solve and a few matmuls; chunks are then scanned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels


CHUNK_SIZE = 32  # tokens per chunk in prefill: 32 ran ~15% faster than 64 here (fewer wasted causal FLOPs)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """[B, T, H*, D] inputs -> contiguous float32 [B, Hv, T, D] (q, k unit-norm, q scaled by D^-1/2,
    key heads repeated to the value heads: value head h reads key head h // rep); g, beta [B, Hv, T]."""
    b, t, hk, d = k.shape
    rep = v.shape[2] // hk
    q = l2norm(q.float()) * d**-0.5
    k = l2norm(k.float())

    def heads(x):  # [B, T, Hk, D] -> [B, Hk * rep, T, D] in one copy
        return x.permute(0, 2, 1, 3).unsqueeze(2).expand(b, hk, rep, t, d).reshape(b, hk * rep, t, d)

    v = v.float().permute(0, 2, 1, 3).contiguous()
    return heads(q), heads(k), v, g.float().transpose(1, 2).contiguous(), beta.float().transpose(1, 2).contiguous()


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form. q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dk, Dv].

    Returns (out [B, T, Hv, Dv] in v's dtype, new float32 state). `state` is not modified.
    """
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float().clone()
    outs = []
    for i in range(q.shape[2]):
        s.mul_(g[:, :, i].exp()[..., None, None])
        kv_mem = (k[:, :, i, None, :] @ s).squeeze(-2)  # [B, Hv, Dv]
        delta = (v[:, :, i] - kv_mem) * beta[:, :, i, None]
        s.add_(k[:, :, i, :, None] * delta[:, :, None, :])
        outs.append((q[:, :, i, None, :] @ s).squeeze(-2))
    out = torch.stack(outs, dim=2)  # [B, Hv, T, Dv]
    return out.transpose(1, 2).to(dtype), s


def gated_delta_step(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token (T = 1), updating the float32 `state` IN PLACE; same maths as the recurrent form.

    The old state is read once for both q and k: with d = exp(g),
        S^T k after decay = d * (S^T k),   o = q^T (d S + k delta^T) = d * (S^T q) + (q . k) delta,
    then S <- d S + k delta^T in place. Returns (out [B, 1, Hv, Dv], state).
    """
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # [B, Hv, 1, D], g / beta [B, Hv, 1]
    decay = g.exp()
    fused = kernels.gated_delta_step(state, q[:, :, 0], k[:, :, 0], v[:, :, 0], decay[..., 0], beta[..., 0])
    if fused is not None:  # CPU: one pass over the state
        return fused[:, None].to(dtype), state
    b, h, _, dk = k.shape
    decay = decay[..., None]  # [B, Hv, 1, 1]
    read = torch.cat([q, k], dim=2) @ state  # [B, Hv, 2, Dv], one pass over the state
    delta = (v - decay * read[:, :, 1:]) * beta[..., None]  # [B, Hv, 1, Dv]
    out = decay * read[:, :, :1] + (q * k).sum(-1, keepdim=True) * delta
    flat = state.view(b * h, dk, -1)
    flat.mul_(decay.view(b * h, 1, 1)).baddbmm_(k.reshape(b * h, dk, 1), delta.reshape(b * h, 1, -1))
    return out.transpose(1, 2).to(dtype), state


def stepwise_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, steps: list[torch.Tensor]
                              ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The recurrent form as T decode steps (`gated_delta_step`, the float32 `state` updated IN PLACE),
    appending a copy of the state after each token but the last to `steps`: a speculative verify
    forward keeps every prefix's state this way (lm/cache.py `Cache.commit`). Arguments and results
    as `recurrent_gated_delta_rule`'s. Costs T - 1 copies of the state beside the T steps."""
    outs = []
    for i in range(v.shape[1]):
        one = slice(i, i + 1)
        out, state = gated_delta_step(q[:, one], k[:, one], v[:, one], g[:, one], beta[:, one], state)
        outs.append(out)
        if i + 1 < v.shape[1]:
            steps.append(state.clone())
    return torch.cat(outs, dim=1), state


def chunked_gated_delta_rule(
    q, k, v, g, beta, state: torch.Tensor, chunk_size: int = CHUNK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel form; same arguments and results as `recurrent_gated_delta_rule`."""
    dtype, t = v.dtype, v.shape[1]
    if (fused := kernels.chunked_delta_rule(q, k, v, g, beta, state, chunk_size)) is not None:
        return fused[0].to(dtype), fused[1]  # CPU: heads side by side, _prepare's work inside
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    pad = (-t) % chunk_size
    if pad:  # padded steps have k = v = 0 and g = 0: they leave the state untouched
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    b, h, n = q.shape[0], q.shape[1], (t + pad) // chunk_size
    q, k, v = (x.reshape(b, h, n, chunk_size, -1) for x in (q, k, v))  # [B, H, N, C, D]
    g, beta = g.reshape(b, h, n, chunk_size), beta.reshape(b, h, n, chunk_size)

    gamma = g.cumsum(-1)  # log decay from chunk start to each position, [B, H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [.., C, C]
    k_beta = k * beta[..., None]
    # Unit lower-triangular system (I + strictly_lower(beta_i k_i.k_j decay_ij)) solved once per chunk.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.tril(-1) + torch.eye(chunk_size, device=q.device)
    rhs = torch.cat([v * beta[..., None], k_beta * gamma.exp()[..., None]], dim=-1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        [v.shape[-1], k.shape[-1]], dim=-1
    )
    intra = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C], causal incl. diagonal
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    s = state.float().clone()
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s  # what the state at chunk start does not already predict
        out[:, :, i] = q_decayed[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, n * chunk_size, -1)[:, :, :t]
    return out.transpose(1, 2).to(dtype), s
