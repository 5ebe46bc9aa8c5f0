"""An experts implementation for mixture-of-experts blocks that exports to ONNX and quantizes.

``transformers`` runs MoE experts through an experts interface (``use_experts_implementation``):
its default on these models, ``grouped_mm``, calls an opaque custom op that ``torch.onnx.export``
cannot trace, and its eager loop iterates over the experts a batch happens to hit (a shape known
only at run time). ``medusa_experts`` is the eager math written for export:

* a fixed loop over every expert; each gathers the rows routed to it (``nonzero``: zero rows for
  an expert no token chose, which costs a matmul of no rows), runs its projections and adds its
  weighted output into those rows, in expert order, as the eager loop does;
* each expert's projections are their own 2-D weights (views of the model's 3-D tensors, no
  copy), so the graph holds one MatMul per expert projection with a plain initializer, which the
  int8-channel and int4 quantizers take like any other linear layer.

The router, shared experts, biases, the gate (the class's own ``_apply_gate``: SwiGLU, gpt-oss's
clamped GLU) and a post-expert norm are the model's own code.
"""

from __future__ import annotations

import torch
from torch import nn

EXPERTS_IMPLEMENTATION = "medusa_experts"


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """x (M, in) times one expert's weight: (out, in), or (in, out) where the layout is transposed."""
    out = x @ weight if transposed else nn.functional.linear(x, weight)  # (M, out)
    return out if bias is None else out + bias


def medusa_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states (N, H), top_k_index int64 (N, k), top_k_weights (N, k) -> (N, H)."""
    split = self._medusa_split  # per expert: its 2-D weights (use_export_experts)
    final = torch.zeros_like(hidden_states)  # (N, H)
    for e in range(self.num_experts):
        chosen = top_k_index == e  # (N, k)
        rows = torch.nonzero(chosen.any(dim=-1)).squeeze(-1)  # (M,) tokens routed to expert e
        weight = (top_k_weights * chosen.to(top_k_weights.dtype)).sum(dim=-1)  # (N,): its routing weight, 0 elsewhere
        x = hidden_states.index_select(0, rows)  # (M, H)
        up = _linear(x, split[f"up{e}"], split[f"up_bias{e}"] if self.has_bias else None, self.is_transposed)  # (M, 2I | I)
        h = self._apply_gate(up) if self.has_gate else self.act_fn(up)  # (M, I)
        out = _linear(h, split[f"down{e}"], split[f"down_bias{e}"] if self.has_bias else None, self.is_transposed)  # (M, H)
        if self.has_post_expert_norm:
            out = self.post_expert_norm(out)
        out = out * weight.index_select(0, rows)[:, None]  # (M, H)
        final = final.index_add(0, rows, out.to(final.dtype))
    return final


def _split(module: nn.Module) -> nn.ParameterDict:
    """Each expert's weights as 2-D parameters: views into the module's 3-D tensors (no copy)."""
    up = module.gate_up_proj if module.has_gate else module.up_proj
    up_bias = (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias) if module.has_bias else None
    views = {}
    for e in range(module.num_experts):
        views[f"up{e}"] = nn.Parameter(up.data[e], requires_grad=False)
        views[f"down{e}"] = nn.Parameter(module.down_proj.data[e], requires_grad=False)
        if up_bias is not None:
            views[f"up_bias{e}"] = nn.Parameter(up_bias.data[e], requires_grad=False)
            views[f"down_bias{e}"] = nn.Parameter(module.down_proj_bias.data[e], requires_grad=False)
    return nn.ParameterDict(views)


def _is_experts(module: nn.Module) -> bool:
    """A module made by transformers' ``use_experts_implementation`` (it sets these attributes)."""
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "num_experts", "down_proj"))


def use_export_experts(model: nn.Module) -> int:
    """Route every experts module of ``model`` through ``medusa_experts``; returns how many there are."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, medusa_experts_forward)
    count = 0
    for module in model.modules():
        if _is_experts(module):
            if not hasattr(module, "_medusa_split"):
                module._medusa_split = _split(module)
            count += 1
    if count:
        for config in {id(m.config): m.config for m in model.modules() if _is_experts(m) and hasattr(m, "config")}.values():
            config._experts_implementation = EXPERTS_IMPLEMENTATION
    return count
