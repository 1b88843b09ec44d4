"""LFM2 in PyTorch, computing what llama.cpp's lfm2 graph computes (src/models/lfm2.cpp).

Per block: ``x += op(rms_norm(x) * attn_norm)`` then ``x += ffn(rms_norm(x) * ffn_norm)``, the
op being a short convolution or grouped-query attention:

- short conv: ``in_proj`` to 3 * n_embd, split into B, C, x (in that order); ``B * x`` goes
  through a causal depthwise convolution of width ``l_cache`` (ggml_ssm_conv: output t is
  ``sum_i w[i] * bx[t - (l_cache - 1) + i]``); ``C *`` that, then ``out_proj``.
- attention: q, k, v projections, an RMS norm over each head of q and of k (``attn_q_norm``,
  ``attn_k_norm``), RoPE of the NeoX kind (rotate halves; llama.cpp's rope type for LFM2),
  causal softmax attention scaled by 1/sqrt(head_dim), query head h reading KV head
  h // (n_head / n_head_kv), then ``attn_output``.
- FFN: SwiGLU, ``ffn_down(silu(ffn_gate(x)) * ffn_up(x))``.

The output is tied to the token embedding, after a final RMS norm (``token_embd_norm``).
``state_dict_gguf`` names every tensor as in the GGUF file, in numpy order (a linear layer's
weight is (n_out, n_in), which is what gguf stores as ggml's {n_in, n_out}).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hyspec.modelgen import RMS_EPS, ROPE_FREQ_BASE, SHORTCONV_L_CACHE, ModelShape


@dataclass(frozen=True)
class Config:
    n_vocab: int
    shape: ModelShape

    @property
    def n_embd(self) -> int:
        return self.shape.n_embd


class RMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * self.weight


class ShortConv(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(n_embd, 3 * n_embd, bias=False)
        # (n_embd, l_cache): the GGUF's shortconv.conv in numpy order.
        self.conv = nn.Parameter(torch.empty(n_embd, SHORTCONV_L_CACHE).uniform_(-1, 1) / math.sqrt(SHORTCONV_L_CACHE))
        self.out_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_tokens = x.shape[1]
        b, c, xx = self.in_proj(x).chunk(3, dim=-1)
        bx = (b * xx).transpose(1, 2)  # (batch, n_embd, tokens)
        conv = F.conv1d(bx, self.conv.unsqueeze(1), padding=SHORTCONV_L_CACHE - 1, groups=bx.shape[1])
        return self.out_proj(c * conv[..., :n_tokens].transpose(1, 2))


def rope_tables(n_tokens: int, head_dim: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = ROPE_FREQ_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.arange(n_tokens, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def _rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, tokens, head_dim); pairs (i, i + head_dim / 2).
    x0, x1 = x.chunk(2, dim=-1)
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.n_head, self.n_head_kv, self.head_dim = shape.n_head, shape.n_head_kv, shape.head_dim
        n_kv = self.n_head_kv * self.head_dim
        self.q = nn.Linear(shape.n_embd, shape.n_embd, bias=False)
        self.k = nn.Linear(shape.n_embd, n_kv, bias=False)
        self.v = nn.Linear(shape.n_embd, n_kv, bias=False)
        self.o = nn.Linear(shape.n_embd, shape.n_embd, bias=False)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, n_tokens, _ = x.shape
        q = self.q_norm(self.q(x).view(batch, n_tokens, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(batch, n_tokens, self.n_head_kv, self.head_dim)).transpose(1, 2)
        v = self.v(x).view(batch, n_tokens, self.n_head_kv, self.head_dim).transpose(1, 2)
        q, k = _rope_neox(q, cos, sin), _rope_neox(k, cos, sin)
        group = self.n_head // self.n_head_kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, n_tokens, -1))


class FeedForward(nn.Module):
    def __init__(self, n_embd: int, n_ff: int) -> None:
        super().__init__()
        self.gate = nn.Linear(n_embd, n_ff, bias=False)
        self.up = nn.Linear(n_embd, n_ff, bias=False)
        self.down = nn.Linear(n_ff, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, shape: ModelShape, attention: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(shape.n_embd)
        self.op: nn.Module = Attention(shape) if attention else ShortConv(shape.n_embd)
        self.ffn_norm = RMSNorm(shape.n_embd)
        self.ffn = FeedForward(shape.n_embd, shape.n_ff)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        x = x + (self.op(h, cos, sin) if isinstance(self.op, Attention) else self.op(h))
        return x + self.ffn(self.ffn_norm(x))


class LFM2(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        shape = config.shape
        if shape.n_embd % shape.n_head or shape.n_head % shape.n_head_kv or shape.head_dim % 2:
            raise ValueError(f"bad head layout: {shape}")
        if not 0 < len(shape.attn_layers) < shape.n_layer or max(shape.attn_layers) >= shape.n_layer:
            raise ValueError(f"an LFM2 needs both short-conv and attention blocks: {shape}")
        self.embed = nn.Embedding(config.n_vocab, shape.n_embd)
        self.blocks = nn.ModuleList(Block(shape, i in shape.attn_layers) for i in range(shape.n_layer))
        self.norm = RMSNorm(shape.n_embd)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2's: N(0, 0.02), the projections back into the residual stream scaled by depth.
        residual_std = 0.02 / math.sqrt(2 * self.config.shape.n_layer)
        for name, p in self.named_parameters():
            if p.ndim == 2 and not name.endswith(".conv"):
                std = residual_std if name.endswith(("o.weight", "out_proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, tokens, n_vocab) for token ids (batch, tokens), positions 0, 1, ..."""
        cos, sin = rope_tables(tokens.shape[1], self.config.shape.head_dim, tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x) @ self.embed.weight.T

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def state_dict_gguf(self) -> dict[str, np.ndarray]:
        """Every weight as a float32 array named as in the GGUF file."""
        out = {"token_embd.weight": self.embed.weight, "token_embd_norm.weight": self.norm.weight}
        for i, block in enumerate(self.blocks):
            blk = f"blk.{i}"
            out[f"{blk}.attn_norm.weight"] = block.attn_norm.weight
            op = block.op
            if isinstance(op, Attention):
                out |= {
                    f"{blk}.attn_q.weight": op.q.weight,
                    f"{blk}.attn_k.weight": op.k.weight,
                    f"{blk}.attn_v.weight": op.v.weight,
                    f"{blk}.attn_output.weight": op.o.weight,
                    f"{blk}.attn_q_norm.weight": op.q_norm.weight,
                    f"{blk}.attn_k_norm.weight": op.k_norm.weight,
                }
            else:
                assert isinstance(op, ShortConv)
                out |= {
                    f"{blk}.shortconv.conv.weight": op.conv,
                    f"{blk}.shortconv.in_proj.weight": op.in_proj.weight,
                    f"{blk}.shortconv.out_proj.weight": op.out_proj.weight,
                }
            out |= {
                f"{blk}.ffn_norm.weight": block.ffn_norm.weight,
                f"{blk}.ffn_gate.weight": block.ffn.gate.weight,
                f"{blk}.ffn_up.weight": block.ffn.up.weight,
                f"{blk}.ffn_down.weight": block.ffn.down.weight,
            }
        return {k: v.detach().to(torch.float32).cpu().numpy().copy() for k, v in out.items()}
