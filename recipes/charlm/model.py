"""A small GPT: pre-LayerNorm transformer blocks over byte embeddings, as nanoGPT builds it
(the same parameter names, so its users find their way)."""

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        # (batch, time, 3 * channels) -> three (batch, head, time, channels per head)
        q, k, v = self.c_attn(x).view(batch, time, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(batch, time, channels)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Logits ``[batch, time, vocab_size]`` for token ids ``[batch, time]``, time <= block_size."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                 n_embd: int, dropout: float = 0.0, tie_weights: bool = True) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight
        for name, parameter in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(parameter)
            elif parameter.ndim == 2:  # GPT-2's init; residual projections scaled by depth
                scale = math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 1.0
                nn.init.normal_(parameter, std=0.02 / scale)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor, new_tokens: int, generator: torch.Generator,
                 temperature: float = 0.8) -> torch.Tensor:
        """``prompt`` [1, time] followed by ``new_tokens`` sampled ones, drawn from
        ``generator`` only (the global RNG is left as it was)."""
        idx = prompt
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block_size:])[:, -1].float() / temperature
            token = torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator)
            idx = torch.cat([idx, token.to(idx.device)], dim=1)
        return idx


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: the weights of linear layers decay; biases, norms and embeddings
    (also when tied to the output layer) do not."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decayed = {id(m.weight): m.weight for m in model.modules()
               if isinstance(m, nn.Linear) and id(m.weight) not in embeddings}
    return [{"params": list(decayed.values()), "weight_decay": weight_decay},
            {"params": [p for p in model.parameters() if id(p) not in decayed],
             "weight_decay": 0.0}]
