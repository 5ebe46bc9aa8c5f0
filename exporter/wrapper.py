"""The export wrapper: base model + Medusa heads behind the engine step contract (docs/architecture.md).

``MedusaModel.forward`` scores T new tokens per sequence against the committed KV cache under a
tree mask. It wraps the ``transformers`` model as it is: the only hook is a registered attention
function (``medusa_tree``) that reads the committed cache of its layer from the step's scratch
(``_StepKV``) and the visibility bias from its mask argument, so the model's own projections, rotary
embeddings, norms and MLPs run unchanged. The scratch arrives as the ``medusa_kv`` keyword where the
model passes its forward's kwargs down to attention, else through ``attention_scratch`` (a context
variable set around the forward: StableLM's and Nemotron's decoder layers drop the kwargs). Outside
a step the function runs the attention the model was loaded with, so the same model object still
serves ``transformers`` ``generate()``.

Two forms of the attention, fixed when a model is made (``MedusaModel(..., attention_form=)``, or ``in_form`` for a
view of the same modules in the other): ``"onnx"`` (the default) is the reference math in
standard ops, which every exporter and runtime understands; ``"plugin"`` calls the custom op
``torch.ops.medusa_trt.tree_attention`` once per layer, which ``torch.onnx.export`` turns into one
``medusa_trt::TreeAttention`` node (``plugins/tree_attention/spec.py``) for TensorRT's plugin. In
eager torch on a CUDA device the standard form runs the Triton kernel
(``plugins/tree_attention/dispatch.py``) where that module is installed.

Heads run in a separate small call (``propose``) on the hidden state of one node per sequence
(the last accepted one), not on every tree node: with a 49k-token shared ``lm_head`` the heads on
all T nodes cost about as much as the base model itself.
"""

from __future__ import annotations

import copy
import functools
import importlib
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from medusa_trt.exporter.architecture import (
    AttentionPlan,
    Probe,
    UnsupportedModelError,
    attention_scratch,
    current_scratch,
    probe_attention,
    record_call,
)
from medusa_trt.exporter.experts import use_export_experts
from medusa_trt.exporter.heads import MedusaHeads
from medusa_trt.exporter.models import BaseModel
from medusa_trt.plugins.tree_attention.reference import key_positions, scattered_bias, tree_attention, visibility_bias, window_bias

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "medusa_tree"
ATTENTION_FORMS = ("onnx", "plugin")  # standard ops | one custom node per layer (TensorRT plugin)


@dataclass
class _StepKV:
    """Per-call scratch for every attention layer: the ``medusa_kv`` keyword, else ``current_scratch()``."""

    past_key: torch.Tensor  # [S, layers, B, Hkv, D] committed cache (slot-major: its first S slots are contiguous)
    past_value: torch.Tensor  # [S, layers, B, Hkv, D]
    tree_mask: torch.Tensor  # bool [B, T, T]
    cache_lengths: torch.Tensor  # int64 [B]
    attention_form: str = "onnx"  # one of ATTENTION_FORMS
    key_slots: torch.Tensor | None = None  # int64 [B, T]: scatter the new K/V into the view there (runtime/key_slots.py)
    position_ids: torch.Tensor | None = None  # int64 [B, T]: the new tokens' positions (sliding windows)
    new_key: list = field(default_factory=list)  # per layer [B, Hkv, T, D]
    new_value: list = field(default_factory=list)
    _windowed: dict = field(default_factory=dict)  # window -> bias, built once per step for all layers of that window

    def windowed(self, bias: torch.Tensor, window: int) -> torch.Tensor:
        """``bias`` [B, 1, T, K] with keys ``window`` or more positions behind their query masked."""
        if window not in self._windowed:
            positions = key_positions(self.cache_lengths, self.position_ids, self.past_key.shape[0], self.key_slots)  # (B, K)
            self._windowed[window] = window_bias(bias, self.position_ids, positions, window)
        return self._windowed[window]


@functools.cache
def _kernel_attend():
    """``dispatch.attend`` (Triton kernel on CUDA) when that module is installed, else None."""
    name = "medusa_trt.plugins.tree_attention.dispatch"
    try:
        return importlib.import_module(name).attend
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None


def _original_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention the model was loaded with (eager, sdpa, ...), for plain ``transformers`` use of a
    wrapped model: ``generate()`` on it stays the model's own reference."""
    import sys

    from transformers import AttentionInterface

    name = getattr(module.config, "_medusa_original_attention", None) or "sdpa"
    if name == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as fn
        if attention_mask is not None and attention_mask.dtype == torch.bool:  # our mask function makes sdpa's bool masks
            attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(~attention_mask, torch.finfo(query.dtype).min)
    else:
        fn = AttentionInterface()[name]
    return fn(module, query, key, value, attention_mask, **kwargs)


def _medusa_tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, medusa_kv=None, **kwargs):
    """transformers attention interface: query [B, Hq, T, D], key/value [B, Hkv, T, D] (rotary applied).

    Returns ([B, T, Hq, D], None) like the built-in implementations. The layer's attention features
    arrive as keywords (``sliding_window``, ``softcap``, ``s_aux`` sinks) and are honoured here in
    every form; ``exporter/architecture.py`` refuses, at load, any keyword not implemented."""
    if medusa_kv is None:  # a model whose layers drop **kwargs (Nemotron, StableLM): the scratch set around the forward
        medusa_kv = current_scratch()
    if medusa_kv is None:  # plain transformers use of the same model object
        return _original_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if isinstance(medusa_kv, Probe):  # MedusaModel's load-time probe: what does this layer ask for?
        return record_call(medusa_kv, module, query, key, dict(kwargs, scaling=scaling, dropout=dropout)), None
    kv = medusa_kv
    layer = len(kv.new_key)  # call order: the probe checked that every layer attends once, in order
    kv.new_key.append(key)
    kv.new_value.append(value)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or None
    softcap = kwargs.get("softcap") or None
    sinks = kwargs.get("s_aux")
    if kv.attention_form == "plugin":  # one opaque op: exported as the spec's custom node (window, softcap 0: none)
        from medusa_trt.plugins.tree_attention import torch_op  # noqa: F401 - registers torch.ops.medusa_trt
        from medusa_trt.plugins.tree_attention.spec import NO_SINK

        sinks = query.new_full(query.shape[1:2], NO_SINK) if sinks is None else sinks.to(query.dtype)  # (Hq,): the node always has them
        inputs = (query, key, value, kv.past_key, kv.past_value, kv.tree_mask, kv.cache_lengths, sinks)
        out = torch.ops.medusa_trt.tree_attention(*inputs, layer, scale, int(window or 0), float(softcap or 0))
    elif kv.key_slots is None and query.is_cuda and not torch.compiler.is_compiling() and _kernel_attend() is not None:
        # the kernel's positions are the step contract's (cache_lengths + depth), the position_ids given here
        inputs = (query, key, value, kv.past_key, kv.past_value, kv.tree_mask, kv.cache_lengths, sinks)
        out = _kernel_attend()(*inputs, layer=layer, scale=scale, window=int(window or 0), softcap=float(softcap or 0))
    else:  # reference math in standard ops (what the standard ONNX graph holds)
        past_key = kv.past_key[:, layer].permute(1, 2, 0, 3)  # (S, B, Hkv, D) -> (B, Hkv, S, D)
        past_value = kv.past_value[:, layer].permute(1, 2, 0, 3)
        bias = attention_mask if window is None else kv.windowed(attention_mask, int(window))
        out = tree_attention(query, key, value, past_key, past_value, bias, scale, kv.key_slots, softcap, sinks)  # (B, Hq, T, D)
    return out.transpose(1, 2).contiguous(), None


def _original_mask(*args, config=None, **kwargs):
    """transformers' mask for the implementation the model was loaded with: an eager model gets its
    additive mask (an sdpa mask may be None, meaning "causal", which eager attention cannot read).
    A step of the engine passes its own 4D bias, which transformers hands through without calling this."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    name = getattr(config, "_medusa_original_attention", None) or "sdpa"
    fn = ALL_MASK_ATTENTION_FUNCTIONS[name] if name in ALL_MASK_ATTENTION_FUNCTIONS else sdpa_mask
    return fn(*args, config=config, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_IMPLEMENTATION, _medusa_tree_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, _original_mask)


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


class MedusaModel(nn.Module):
    """Base causal LM + optional Medusa heads, following the engine step contract.

    Carries the tokenizer and EOS ids as plain attributes for the runtime; ``forward`` never uses them.
    """

    def __init__(self, base: BaseModel, heads: MedusaHeads | None, *, attention_form: str = "onnx"):
        super().__init__()
        if attention_form not in ATTENTION_FORMS:
            raise ValueError(f"attention_form {attention_form!r} is not one of {', '.join(ATTENTION_FORMS)}")
        _register_attention()
        self.base = base.model
        config = self.base.config
        if config._attn_implementation != ATTN_IMPLEMENTATION:  # kept for plain transformers use (_original_attention)
            config._medusa_original_attention = config._attn_implementation
        # routes every family whose attention classes look the implementation up in transformers' AttentionInterface,
        # StableLM too: its _supports_attention_backend = False (read by vLLM and TGI, not by this routing) reflects that
        # its layers drop **kwargs, which the scratch's context variable covers. A family computing attention in its own
        # modules (Bloom, Falcon, GPT-Neo, MPT) keeps it: transformers only warns, and the probe refuses it by name.
        self.base.set_attn_implementation(ATTN_IMPLEMENTATION)
        use_export_experts(self.base)  # MoE blocks: an experts implementation that exports (exporter/experts.py)
        self.attention: AttentionPlan = probe_attention(self.base, lambda probe: probe)  # refuses what it cannot serve
        first = next(self.base.parameters())
        self.heads = heads.to(device=first.device, dtype=first.dtype) if heads is not None else None
        self.tokenizer = base.tokenizer
        self.tokenizer_files = base.tokenizer_files  # the source's tokenizer.json folder (None: converted at export)
        self.eos_token_ids = base.eos_token_ids
        self.is_chat = base.is_chat
        self.name = base.name
        cfg = self.base.config
        self.head_layer = heads.config.head_layer if heads is not None else None
        self.num_heads = heads.config.num_heads if heads is not None else 0
        self.vocab_size = cfg.vocab_size
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self.attention_form = attention_form  # ATTENTION_FORMS: how forward computes attention (in_form: the other)
        self.draft_vocab: int | None = None  # propose() covers token ids 0 .. N-1 only, as an engine exported with --draft-vocab N
        self.tree: str | None = None  # the heads' own template (their folder's export.json), what runs by default; None: a chain

    def in_form(self, attention_form: str) -> MedusaModel:
        """This model whose attention runs as ``attention_form`` (ATTENTION_FORMS): a view sharing every module and
        weight (nothing copied), so the exporter traces the plugin form while the caller's model keeps its own."""
        if attention_form not in ATTENTION_FORMS:
            raise ValueError(f"attention_form {attention_form!r} is not one of {', '.join(ATTENTION_FORMS)}")
        if attention_form == self.attention_form:
            return self
        view = copy.copy(self)  # a new object over the same _modules / _parameters dicts
        view.attention_form = attention_form
        return view

    @property
    def kv_spec(self) -> KVSpec:
        """Cache geometry; the dtype follows the weights (after ``.to(torch.float16)`` too)."""
        plan = self.attention
        return KVSpec(len(plan.layers), plan.num_kv_heads, plan.head_dim, next(self.base.parameters()).dtype)

    def describe(self) -> str:
        """One line for what medusa-export prints: the architecture, its attention, experts, final soft-cap."""
        text = self.attention.describe()
        cfg = self.base.config
        experts = sum(1 for m in self.base.modules() if hasattr(m, "_medusa_split"))
        if experts:
            text += f"; {experts} mixture-of-experts blocks"
        if getattr(cfg, "final_logit_softcapping", None):
            text += f"; final logit soft-cap {cfg.final_logit_softcapping:g}"
        return text

    def check_form(self, form: str) -> None:
        """Refuse an attention form that does not implement a feature this model's layers ask for.

        The standard form is the reference math, which implements every ``LayerAttention`` field; the
        plugin form implements what its op's spec lists (``spec.TREE_ATTENTION.features``)."""
        if form != "plugin":
            return
        from medusa_trt.plugins.tree_attention.spec import TREE_ATTENTION

        asked = {name for layer in self.attention.layers for name in ("window", "softcap", "sinks") if getattr(layer, name)}
        missing = sorted(asked - set(TREE_ATTENTION.features))
        if missing:
            raise UnsupportedModelError(
                f"--attention plugin: the tree-attention plugin ({TREE_ATTENTION.qualified_name} v{TREE_ATTENTION.version}) does not "
                f"implement this {self.attention.architecture} model's {', '.join(missing)}: export with --attention onnx"
            )

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [B, T]
        position_ids: torch.Tensor,  # int64 [B, T]: cache_lengths[b] + depth(node)
        tree_mask: torch.Tensor,  # bool [B, T, T]: node i sees node j
        cache_lengths: torch.Tensor,  # int64 [B]: committed tokens per sequence
        past_key: torch.Tensor,  # [S, layers, B, Hkv, D], S >= max(cache_lengths)
        past_value: torch.Tensor,  # [S, layers, B, Hkv, D]
        key_slots: torch.Tensor | None = None,  # int64 [B, T]: each new key's slot in the view (runtime/key_slots.py); S > its max
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns logits [B, T, V], head-input hidden [B, T, H], the base argmax next_ids [B, T]
        (all greedy acceptance needs, so a backend need not copy the logits out) and the new
        key/value [T, layers, B, Hkv, D].

        The cache is slot-major so that the first S slots of a preallocated buffer are one
        contiguous block: ONNX Runtime can bind them without a copy. With ``key_slots`` the new
        keys are scattered into the view (over its stale slots) instead of appended after it, so a
        verify step can lay every key out as plain decoding does (runtime/key_slots.py)."""
        if key_slots is not None and self.attention_form == "plugin":
            raise ValueError("the plugin attention appends the new keys: key_slots is for the standard form")
        kv = _StepKV(past_key, past_value, tree_mask, cache_lengths, self.attention_form, key_slots, position_ids)
        # the plugin form reads tree_mask and cache_lengths itself; its traced graph drops this bias as dead code
        if key_slots is None:
            bias = visibility_bias(cache_lengths, tree_mask, past_key.shape[0], self.kv_spec.dtype)  # (B, 1, T, S+T)
        else:
            bias = scattered_bias(cache_lengths, tree_mask, key_slots, past_key.shape[0], self.kv_spec.dtype)  # (B, 1, T, S)
        # the whole causal LM, so its own logit processing (final soft-capping, Granite's logits scaling) stays in
        with attention_scratch(kv):
            out = self.base(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=bias,  # 4D: passed through untouched to the attention function
                use_cache=False,
                output_hidden_states=True,
                logits_to_keep=0,
                medusa_kv=kv,
            )
        logits = out.logits  # (B, T, V)
        # hidden_states[-1] is the decoder's output after its final norm (transformers ties it to last_hidden_state)
        hidden = out.hidden_states[-1 if self.head_layer is None else self.head_layer + 1]  # (B, T, H)
        new_key = torch.stack(kv.new_key).permute(3, 0, 1, 2, 4)  # (layers, B, Hkv, T, D) -> (T, layers, B, Hkv, D)
        new_value = torch.stack(kv.new_value).permute(3, 0, 1, 2, 4)
        return logits, hidden, logits.argmax(dim=-1), new_key.contiguous(), new_value.contiguous()

    @property
    def head_input(self) -> str:
        return self.heads.config.head_input if self.heads is not None else "hidden"

    def propose(self, hidden: torch.Tensor, roots: torch.Tensor | None = None, expansion=None, top_k: int = 0) -> torch.Tensor:
        """Head logits [B, n, V] for one hidden state per sequence [B, H] ([B, n, N] with a draft
        vocabulary of N ids); ``roots`` [B] int64, the token chosen after it, for next-token-aware heads.
        Sequential heads expand ``expansion`` (a template's ``Expansion``) along their top-``top_k``:
        [B, P, V], one row per expanded node."""
        if self.heads is None:
            raise ValueError("this model has no Medusa heads: load heads or use the tree chain-0")
        if self.heads.config.reads_path:
            if expansion is None:
                raise ValueError("sequential heads expand a template: pass its expansion (runtime.drafting.sequential) and top_k")
            return self.heads.expand(hidden, roots, expansion, top_k, self.heads.projector(self.draft_vocab))
        logits = self.heads(hidden, roots if self.heads.config.reads_next else None)
        return logits if self.draft_vocab is None else logits[..., : self.draft_vocab]


class HeadsGraph(nn.Module):
    """The heads call as its own graph: hidden [B, H] (and root_ids [B] for next-token-aware heads)
    -> (top-k ids [B, n, K], logits fp32 [B, n, N]) over the draft vocabulary: the first N token
    ids (``draft_vocab``; None: the whole vocabulary). The heads only draft, so a draft vocabulary
    never changes what the base model emits; it shrinks the projection the heads call reads from
    memory after every verify step (byte-level BPE gives the most frequent tokens the lowest ids,
    as merges are learnt in frequency order)."""

    def __init__(self, heads: MedusaHeads, top_k: int, draft_vocab: int | None = None, plan=None):
        super().__init__()
        self.heads, self.top_k = heads, top_k
        self.draft_vocab = draft_vocab
        self.plan = plan  # sequential heads: the template's Expansion (outputs [B, P, K] and [B, P, N])
        if heads.config.reads_path and plan is None:
            raise ValueError("sequential heads expand a template: pass its Expansion as plan=")
        if draft_vocab is not None:  # own copies: the exported graph holds only these rows
            self.vocab_rows = nn.ParameterList(
                [nn.Parameter(w.detach().clone(), requires_grad=False) for w in heads.projection_weights(draft_vocab)]
            )

    def _project(self, k: int, x: torch.Tensor) -> torch.Tensor:
        if self.draft_vocab is None:
            return self.heads.project(x, k)
        return nn.functional.linear(x, self.vocab_rows[0 if len(self.vocab_rows) == 1 else k])

    def forward(self, hidden: torch.Tensor, root_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.plan is not None:  # sequential heads: the template expanded depth by depth, in this one call
            logits = self.heads.expand(hidden, root_ids, self.plan, self.top_k, self._project)  # (B, P, N)
        elif self.draft_vocab is None:
            logits = self.heads(hidden, root_ids).float()  # (B, n, V)
        else:
            blocks = self.heads.blocks(hidden, root_ids)  # (B, n, H)
            if len(self.vocab_rows) == 1:  # shared lm_head: one projection for every head
                logits = nn.functional.linear(blocks, self.vocab_rows[0]).float()  # (B, n, N)
            else:
                logits = torch.stack([nn.functional.linear(blocks[:, k], w) for k, w in enumerate(self.vocab_rows)], dim=1).float()
        return logits.topk(self.top_k, dim=-1).indices, logits


def load_medusa(
    model: str,
    heads: str | MedusaHeads | None = None,
    *,
    untrained_heads: int | None = None,
    head_layer: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    weights: bool = True,
) -> MedusaModel:
    """Load a base model (see ``models.load_base_model``; ``weights=False``: weightless, for a streamed export) and
    heads: a path, a module, or ``untrained_heads`` fresh ones (identity blocks on the shared lm_head: they run the
    loop, they do not speed it up)."""
    from medusa_trt.exporter.heads import HeadsConfig, init_heads, load_heads
    from medusa_trt.exporter.models import load_base_model

    base = load_base_model(model, dtype=dtype, device=device, weights=weights)
    cfg = base.model.config
    tree = None
    if isinstance(heads, (str, bytes)) or hasattr(heads, "__fspath__"):
        from medusa_trt.exporter.export_defaults import read_export_defaults

        tree = read_export_defaults(heads).tree  # the template the heads were tuned for, as their export uses
        heads = load_heads(
            heads,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            lm_head=base.model.get_output_embeddings(),
            num_decoder_layers=cfg.num_hidden_layers,
            head_layer=head_layer,
            embed=base.model.get_input_embeddings(),
        )
    elif heads is None and untrained_heads:
        config = HeadsConfig(untrained_heads, 1, cfg.hidden_size, cfg.vocab_size, shared_lm_head=True, head_layer=head_layer)
        heads = init_heads(config, base.model.get_output_embeddings())
    if heads is not None:
        heads = heads.eval().requires_grad_(False)  # MedusaModel puts them on the base's device and dtype
    medusa = MedusaModel(base, heads)
    medusa.tree = tree
    return medusa
