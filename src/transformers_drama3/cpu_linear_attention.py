"""Linear attention on the CPU path: transformers' gated delta rule layer with a one-token step of its own.

Three of every four backbone layers are linear attention (`Qwen3_5MoeGatedDeltaNet`): each keeps a recurrent state
`S [b, Hv, dk, dv]` (2 MiB per sequence at the real width: 32 value heads of 128 x 128 in float32) that every token
decays, corrects and reads. For one token transformers runs its reference recurrence, which builds the new state from
broadcast products and sums over the key dimension. Inside the CPU path's compiled frame step inductor fused that
into one C++ kernel that, in two of the three linear-attention layers of a 4-layer real-width backbone, wrote the new
state in a transposed layout one float at a time and transposed it back into the cache: 2.1 ms a layer against
0.5 ms for the same kernel in the third layer (1 thread; docs/performance.md, "Linear attention in a decode step").

`CpuGatedDeltaNet.forward` takes that step itself. With `decay = exp(g)`, `delta = (v - decay * k^T S) * beta`,
the rule's new state and output are

    S' = decay * S + k delta^T        out = q^T S' = decay * q^T S + (q . k) delta

so both reads of the state are one batched product of the two rows `[k; q]` with `S` (torch's matrix kernel reads `S`
once), and the new state is one elementwise pass over it. The query and key are L2-normalised and the query scaled by
`dk ** -0.5`, and each key head serves `Hv // Hk` consecutive value heads, as in transformers' rule. The outputs are
transformers' up to the order of float32 sums (tests/test_cpu_linear_attention.py). A prefill, a step without a
stored state, and everything transformers 5.17 does while it records past states, run transformers' own forward.

The CPU path (`cpu_path.apply_cpu_path`) gives the float16, int8 and bfloat16 paths' layers this class; the float32
path, the exact reference, keeps transformers' class.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

from .compat import linear_attention_cache, one_token_convolution, one_token_state


def gated_delta_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule (module docstring): `query`, `key` `[b, 1, Hk, dk]`, `value` `[b, 1, Hv, dv]`,
    `g` (log decay) and `beta` `[b, 1, Hv]`, `state` `[b, Hv, dk, dv]` -> (output `[b, 1, Hv, dv]` in `value`'s dtype,
    new state `[b, Hv, dk, dv]` float32)."""
    groups = value.shape[2] // key.shape[2]
    q = modeling.l2norm(query[:, 0].float(), dim=-1, eps=1e-6) * query.shape[-1] ** -0.5  # [b, Hk, dk]
    k = modeling.l2norm(key[:, 0].float(), dim=-1, eps=1e-6)  # [b, Hk, dk]
    q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)  # [b, Hv, dk]
    state = state.float()
    read = torch.matmul(torch.stack((k, q), dim=2), state)  # [b, Hv, 2, dv]: k^T S, q^T S
    decay = g[:, 0].float().exp()[..., None]  # [b, Hv, 1]
    delta = (value[:, 0].float() - decay * read[:, :, 0]) * beta[:, 0].float()[..., None]  # [b, Hv, dv]
    new_state = state * decay[..., None] + k[..., :, None] * delta[..., None, :]  # [b, Hv, dk, dv]
    out = decay * read[:, :, 1] + (q * k).sum(-1, keepdim=True) * delta  # [b, Hv, dv]
    return out[:, None].to(value.dtype), new_state


class CpuGatedDeltaNet(Qwen3_5MoeGatedDeltaNet):
    """transformers' linear-attention layer whose one-token step with a stored state is `gated_delta_step` (module
    docstring); every other call is transformers' forward."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        cache = linear_attention_cache(args, kwargs)
        batch, rows, _ = hidden_states.shape
        state = one_token_state(self, cache) if rows == 1 and kwargs.get("cu_seq_lens_q") is None else None
        if state is None:
            return super().forward(hidden_states, *args, **kwargs)
        # transformers' signature on every supported version: (hidden_states, cache, attention_mask, **kwargs)
        attention_mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        hidden_states = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
        mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)  # [b, 2 Hk dk + Hv dv, 1]
        mixed_qkv = one_token_convolution(self, mixed_qkv, cache).transpose(1, 2)  # [b, 1, 2 Hk dk + Hv dv]
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, 1, -1, self.head_k_dim)  # [b, 1, Hk, dk]
        key = key.reshape(batch, 1, -1, self.head_k_dim)  # [b, 1, Hk, dk]
        value = value.reshape(batch, 1, -1, self.head_v_dim)  # [b, 1, Hv, dv]
        beta = self.in_proj_b(hidden_states).sigmoid()  # [b, 1, Hv]
        g = -self.A_log.float().exp() * torch.nn.functional.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias)
        out, new_state = gated_delta_step(query, key, value, g, beta, state)
        cache.update_recurrent_state(new_state, self.layer_idx)
        z = self.in_proj_z(hidden_states).reshape(-1, self.head_v_dim)  # [b Hv, dv]
        out = self.norm(out.reshape(-1, self.head_v_dim), z).reshape(batch, 1, -1)  # [b, 1, Hv dv]
        return self.out_proj(out)


def use_cpu_linear_attention(model: torch.nn.Module) -> int:
    """Give every transformers linear-attention layer of `model` the class `CpuGatedDeltaNet`, in place (the same
    parameters and buffers: the class only adds a forward). Layers under an accelerate hook (offloaded) keep theirs:
    transformers' forward runs the hooks its convolution needs. Returns how many layers changed."""
    changed = 0
    for module in model.modules():
        if type(module) is Qwen3_5MoeGatedDeltaNet and not any(hasattr(m, "_hf_hook") for m in module.modules()):
            module.__class__ = CpuGatedDeltaNet
            changed += 1
    return changed


__all__ = ["CpuGatedDeltaNet", "gated_delta_step", "use_cpu_linear_attention"]
