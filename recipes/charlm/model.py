"""A small GPT as nanoGPT builds it: pre-LayerNorm transformer blocks over byte embeddings,
with nanoGPT's module and state_dict names (``transformer.wte``, ``transformer.h.0.attn.c_attn``,
``transformer.h.0.mlp.c_proj``, ``lm_head``, ...), its weight tying and its GPT-2 init."""

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


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


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Logits ``[batch, time, vocab_size]`` for token ids ``[batch, time]``, time <= block_size.

    ``tie_weights``: the token embedding is the output layer's weight (nanoGPT's
    ``transformer.wte.weight = lm_head.weight``; ``state_dict`` holds both keys).

    ``activation_checkpointing``: while gradients are recorded, each block keeps only its
    input for the backward and runs its forward again there (``torch.utils.checkpoint``,
    non-reentrant: the same numbers, the dropout masks included, for about one more forward
    of the blocks). The non-reentrant form is the one that composes with
    ``torch.distributed.fsdp.fully_shard``: the block is called through its own
    ``__call__`` inside the checkpoint, so FSDP's hooks on the block gather its parameters
    again for the recomputation, and the parameter names stay the same (``checkpoint_wrapper``
    would insert ``_checkpoint_wrapped_module`` into every name below the blocks, which the
    name-based weight decay and Muon groups and ``fully_shard``'s targets would have to see
    through)."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                 n_embd: int, dropout: float = 0.0, tie_weights: bool = True,
                 activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.block_size, self.activation_checkpointing = block_size, activation_checkpointing
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab_size, n_embd),
            "wpe": nn.Embedding(block_size, n_embd),
            "drop": nn.Dropout(dropout),
            "h": nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer)),
            "ln_f": nn.LayerNorm(n_embd),
        })
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.transformer.wte.weight = self.lm_head.weight
        init_gpt2(self, n_layer)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.transformer.h:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def training_flops_per_sample(self) -> int:
        """Model FLOPs of forward + backward for one window of ``block_size`` tokens: per
        token 6N + 12 * n_layer * n_head * head_dim * block_size, the estimate of the PaLM
        paper (appendix B) as nanoGPT's ``estimate_mfu`` computes it. N counts every
        parameter except the embeddings that are looked up rather than multiplied: the
        position embedding, and the token embedding unless it is the output layer's weight
        (tied, as by default: then it counts once, as that layer). Biases and LayerNorm
        weights are in N, as in nanoGPT's ``get_num_params()``. The attention term counts
        the whole T x T score matrix, although causal attention needs about half of it.
        Recomputation by activation checkpointing is not model FLOPs and is not counted."""
        wte, wpe = self.transformer.wte.weight, self.transformer.wpe.weight
        n = sum(parameter.numel() for parameter in self.parameters()) - wpe.numel()
        if wte is not self.lm_head.weight:
            n -= wte.numel()
        n_layer, n_embd = len(self.transformer.h), wte.shape[1]  # n_head * head_dim = n_embd
        per_token = 6 * n + 12 * n_layer * n_embd * self.block_size
        return per_token * self.block_size

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor, new_tokens: int, generator: torch.Generator,
                 temperature: float = 0.8, top_k: int | None = None) -> torch.Tensor:
        """``prompt`` [1, time] followed by ``new_tokens`` sampled ones, drawn from
        ``generator`` only (the global RNG is left as it was); with ``top_k``, from the
        ``top_k`` likeliest tokens only (nanoGPT's ``sample.py``)."""
        idx = prompt
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block_size:])[:, -1].float() / temperature
            if top_k is not None:
                kth = logits.topk(min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -float("inf"))
            token = torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator)
            idx = torch.cat([idx, token.to(idx.device)], dim=1)
        return idx


def init_gpt2(model: nn.Module, n_layer: int) -> None:
    """GPT-2's init, as nanoGPT applies it: every weight matrix and embedding normal with std
    0.02, biases zero, norms left at one; the residual projections (``c_proj.weight`` of the
    attention and of the MLP: 2 * n_layer branches add into the residual stream) at
    0.02 / sqrt(2 * n_layer), so the stream's variance does not grow with depth."""
    for name, parameter in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(parameter)
        elif parameter.ndim >= 2:
            scale = math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 1.0
            nn.init.normal_(parameter, std=0.02 / scale)
