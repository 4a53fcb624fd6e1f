"""A small decoder-only transformer language model in plain PyTorch, with a KV cache.

Weights come from a seed (nothing is downloaded); the vocabulary is word-level so the
generated text is readable. Imported only when the torch executor is selected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from gpusched_agent.adapters.simulated import WORDS

VOCAB = tuple(f" {w}" for w in WORDS) + tuple(f" {a}{b}" for a in WORDS for b in WORDS[:16])
"""Token id -> text."""


@dataclass(frozen=True)
class TinyConfig:
    dim: int = 256
    layers: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    max_positions: int = 8192
    vocab: int = len(VOCAB)


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.dim // cfg.heads
        self.norm1 = nn.RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.norm2 = nn.RMSNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim, bias=False)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim, bias=False)


class TinyLM(nn.Module):
    """Pre-norm transformer; `prefill` fills a sequence's cache, `decode` runs one step for
    a batch of sequences of different lengths (batched matmuls, per-sequence attention)."""

    def __init__(self, cfg: TinyConfig, seed: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        torch.manual_seed(seed)
        # made and initialised where they run: on a GPU, a 2048 x 16 model took 24 s to
        # load when its 0.8 G weights were drawn on the CPU and copied over
        with torch.device(device):
            self.embed = nn.Embedding(cfg.vocab, cfg.dim)
            self.pos = nn.Embedding(cfg.max_positions, cfg.dim)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
            self.norm = nn.RMSNorm(cfg.dim)
            self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))
        self.to(dtype=dtype).eval()
        self.device, self.dtype = device, dtype

    def new_cache(self, capacity: int) -> torch.Tensor:
        """K and V of every layer for `capacity` tokens: [layers, 2, heads, capacity, hd]."""
        c = self.cfg
        return torch.zeros(c.layers, 2, c.heads, capacity, c.dim // c.heads,
                           device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def prefill(self, tokens: list[int], cache: torch.Tensor) -> torch.Tensor:
        """Logits of the next token after `tokens`; fills cache[:, :, :, :len(tokens)]."""
        n = len(tokens)
        ids = torch.tensor(tokens, device=self.device)
        x = self.embed(ids) + self.pos(torch.arange(n, device=self.device))
        for i, blk in enumerate(self.blocks):
            q, k, v = self._qkv(blk, x)  # [heads, n, hd]
            cache[i, 0, :, :n], cache[i, 1, :, :n] = k, v
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = self._after_attention(blk, x, att)
        return self.head(self.norm(x[-1]))

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int],
               caches: list[torch.Tensor]) -> torch.Tensor:
        """Logits [batch, vocab] for one new token per sequence at its position."""
        ids = torch.tensor(tokens, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        x = self.embed(ids) + self.pos(pos)  # [B, dim]
        for i, blk in enumerate(self.blocks):
            q, k, v = self._qkv(blk, x)  # [heads, B, hd]
            outs = []
            for b, (cache, p) in enumerate(zip(caches, positions)):
                cache[i, 0, :, p], cache[i, 1, :, p] = k[:, b], v[:, b]
                att = F.scaled_dot_product_attention(
                    q[:, b:b + 1], cache[i, 0, :, :p + 1], cache[i, 1, :, :p + 1])
                outs.append(att)
            x = self._after_attention(blk, x, torch.cat(outs, dim=1))
        return self.head(self.norm(x))

    def _qkv(self, blk: Block, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = x.shape[0]
        qkv = blk.qkv(blk.norm1(x)).view(n, 3, blk.heads, blk.head_dim)
        return tuple(qkv[:, j].transpose(0, 1) for j in range(3))

    def _after_attention(self, blk: Block, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = x + blk.proj(att.transpose(0, 1).reshape(n, -1))
        return x + blk.down(F.gelu(blk.up(blk.norm2(x))))


def tokenize(prompt: str, prompt_tokens: int, vocab: int = len(VOCAB)) -> list[int]:
    """Exactly `prompt_tokens` ids: one per 4 UTF-8 bytes (the count gpusched bills, see
    `count_prompt_tokens`), cycled or cut to the requested length."""
    raw = prompt.encode() or b" "
    ids = [int.from_bytes(raw[i:i + 4], "little") % vocab for i in range(0, len(raw), 4)]
    return [ids[i % len(ids)] for i in range(prompt_tokens)]


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
