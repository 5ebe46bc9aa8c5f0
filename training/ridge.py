"""Heads fitted in closed form: a cheap baseline and a test fixture, not the trained heads.

Each head's projection is the ridge-regression solution mapping the base model's final hidden
state at position t to the one-hot token at t + k + 1 (head k, 1-based), over the model's own
greedy continuations (self-distillation, so the labels are the model's tokens). Blocks stay the
identity. One linear solve per head; seconds on CPU for small models.
"""

from __future__ import annotations

import logging

import torch

from medusa_trt.exporter.heads import HeadsConfig, MedusaHeads, init_heads

log = logging.getLogger(__name__)


@torch.no_grad()
def greedy_continuations(model, prompts: list[list[int]], new_tokens: int) -> list[torch.Tensor]:
    """The base model's own greedy continuation of each prompt, prompt included: 1-D int64 tensors."""
    out = []
    for ids in prompts:
        seq = model.generate(
            torch.tensor([ids], device=model.device),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            top_k=None,
            top_p=None,
            temperature=None,
        )
        out.append(seq[0])
    return out


@torch.no_grad()
def fit_heads_ridge(model, sequences: list[torch.Tensor], *, num_heads: int = 4, ridge: float = 1e-2) -> MedusaHeads:
    """Heads (own projections, identity blocks) fitted to ``sequences`` of a transformers causal LM."""
    cfg = model.config
    decoder = model.get_decoder()  # the model without its lm_head, whatever the family calls it
    hidden = [decoder(seq[None]).last_hidden_state[0].float() for seq in sequences]  # each (N, H)
    heads = init_heads(
        HeadsConfig(num_heads=num_heads, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, shared_lm_head=False),
        None,
    )
    for k in range(num_heads):
        shift = k + 2  # head k (0-based) guesses the token k + 2 places after the hidden state's own
        xs = torch.cat([h[: len(s) - shift] for h, s in zip(hidden, sequences)])  # (N, H)
        ys = torch.cat([s[shift:] for s in sequences])  # (N,)
        gram = xs.T @ xs + ridge * torch.eye(xs.shape[1], device=xs.device)  # (H, H)
        xty = torch.zeros(xs.shape[1], cfg.vocab_size, device=xs.device)  # (H, V) = X^T onehot(Y), no dense one-hot
        xty.index_add_(1, ys, xs.T)
        heads.heads[k][-1].weight.copy_(torch.linalg.solve(gram, xty).T)
    log.info("fitted %d heads on %d positions", num_heads, sum(len(s) for s in sequences))
    return heads
