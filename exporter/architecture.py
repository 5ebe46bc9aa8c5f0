"""Which decoders the exporter takes, and what each attention layer asks of the tree attention.

No allow-list of names: any decoder-only causal LM in ``transformers`` whose every layer attends
through the attention interface exports, its own projections, norms, rotary, MLPs and experts
unchanged. What the tree attention must honour is read from the model itself, in two passes:

1. ``check_config`` (before any weight is read): encoder-decoders, cross-attention, chunked
   attention and layers that are not attention (recurrent, convolutional, linear-attention: the
   ``layer_types`` a hybrid's config lists) are refused in one line, naming the feature.
2. ``probe_attention`` (the loaded model, one two-token forward): every layer must call the
   attention interface exactly once, and each call's keyword arguments say what it needs: a
   sliding window, logit soft-capping, attention sinks, its softmax scale, its key/value shape.
   A keyword the tree attention does not implement is refused, never dropped: an engine that
   generates other text than its model is the worst failure this project can have.

The attention function gets its per-forward scratch (the probe here, the step's KV cache in
``exporter/wrapper.py``) from the ``medusa_kv`` keyword where the model threads its forward's
``**kwargs`` down to attention, else from ``attention_scratch``, a context variable set around the
forward: StableLM and Nemotron call the interface but their decoder layers drop ``**kwargs``.

The result is an ``AttentionPlan``: one frozen ``LayerAttention`` per layer, the KV cache
geometry, and the features the engine's forms of the attention must implement.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_trt.runtime.errors import MedusaError

# layer types (config.layer_types and its older spellings) that are attention the tree attention can serve
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention", "global", "local")
_LAYER_TYPE_FIELDS = ("layer_types", "layers_block_type", "block_types")  # where hybrids list their layers

# keywords an attention layer may pass that change nothing in the attention's math (bookkeeping, or
# what the model's own code has already applied: positions to the rotary, the cache we replace)
_BENIGN_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "output_hidden_states",
        "output_attentions",
        "output_router_logits",
        "use_cache",
        "return_dict",
        "layer_idx",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "dropout",
        "is_causal",
    }
)
# keywords the tree attention implements (LayerAttention's fields)
_FEATURE_KWARGS = frozenset({"sliding_window", "softcap", "s_aux", "scaling"})


class UnsupportedModelError(MedusaError):
    """The model has a feature the tree attention cannot verify with a KV cache and a tree mask."""


class ExporterBugError(MedusaError):
    """This project's own code failed on a model (not the model's fault): the message asks for a report."""


# The attention function's scratch for the forward in progress (a Probe, or exporter/wrapper.py's _StepKV).
# A context variable, not a module attribute: set and reset around one forward, per thread, so it reaches
# the attention of models whose layers do not pass **kwargs on, and never outlives the call that set it.
_SCRATCH: ContextVar[object | None] = ContextVar("medusa_kv", default=None)


@contextmanager
def attention_scratch(scratch) -> Iterator[None]:
    """Make ``scratch`` what ``current_scratch()`` returns inside the block (torch.export traces through it)."""
    token = _SCRATCH.set(scratch)
    try:
        yield
    finally:
        _SCRATCH.reset(token)


def current_scratch():
    """The scratch of the forward in progress (None: plain ``transformers`` use of the model)."""
    return _SCRATCH.get()


@dataclass(frozen=True)
class LayerAttention:
    """What one decoder layer's attention call asks for."""

    scale: float  # softmax scale (the layer's own ``scaling``: query_pre_attn_scalar, Granite's multiplier)
    window: int | None = None  # sliding window: a query at position p sees keys at positions > p - window
    softcap: float | None = None  # attention-logit soft-capping: scores = softcap * tanh(scores / softcap)
    sinks: bool = False  # per-head attention sinks (``s_aux``): an extra logit in each softmax, no value


@dataclass(frozen=True)
class AttentionPlan:
    """The attention of every layer, in call order, and the KV cache geometry (uniform over layers)."""

    architecture: str  # config.model_type
    layers: tuple[LayerAttention, ...]
    num_query_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def features(self) -> tuple[str, ...]:
        """Attention features beyond plain causal attention, for messages and docs."""
        found = []
        if any(layer.window for layer in self.layers):
            found.append("sliding window")
        if any(layer.softcap for layer in self.layers):
            found.append("logit soft-capping")
        if any(layer.sinks for layer in self.layers):
            found.append("attention sinks")
        if self.num_kv_heads != self.num_query_heads:
            found.append(f"grouped-query attention ({self.num_query_heads}/{self.num_kv_heads})")
        return tuple(found)

    def describe(self) -> str:
        """One line: ``qwen3: 28 layers, 16 query / 8 key-value heads of 128; sliding window 4096 (14 of 28 layers)``."""
        heads = f"{self.num_query_heads} query / {self.num_kv_heads} key-value heads of {self.head_dim}"
        text = f"{self.architecture}: {len(self.layers)} layers, {heads}"
        notes = []
        for window in self.windows:
            count = sum(layer.window == window for layer in self.layers)
            notes.append(f"sliding window {window} ({count} of {len(self.layers)} layers)")
        softcaps = sorted({layer.softcap for layer in self.layers if layer.softcap})
        notes += [f"logit soft-cap {c:g}" for c in softcaps]
        if any(layer.sinks for layer in self.layers):
            notes.append("attention sinks")
        return text + ("; " + ", ".join(notes) if notes else "")

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct sliding windows, smallest first."""
        return tuple(sorted({layer.window for layer in self.layers if layer.window}))


def _refuse(kind: str, what: str, fix: str = "export a decoder-only model whose every layer is attention") -> UnsupportedModelError:
    return UnsupportedModelError(f"model architecture {kind!r} has {what}, which a KV cache and a tree mask cannot verify: {fix}")


def check_config(config) -> None:
    """Refuse, before any weight is read, what the config alone shows the tree attention cannot serve."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(kind, "an encoder and a decoder (encoder-decoder)")
    if getattr(config, "add_cross_attention", False):
        raise _refuse(kind, "cross-attention")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"model architecture {kind!r} is not a causal language model in transformers (no AutoModelForCausalLM class): "
            "export a decoder-only causal LM"
        )
    if getattr(config, "attention_chunk_size", None):
        raise _refuse(kind, f"chunked attention (attention_chunk_size {config.attention_chunk_size})")
    for name in _LAYER_TYPE_FIELDS:
        types = getattr(config, name, None)
        if not isinstance(types, (list, tuple)):
            continue
        for i, layer_type in enumerate(types):
            if str(layer_type) not in ATTENTION_LAYER_TYPES:
                raise _refuse(kind, f"{layer_type!r} layers (layer {i}: recurrent, convolutional or linear attention)")
    pattern = getattr(config, "hybrid_override_pattern", None)
    if isinstance(pattern, str) and any(c not in "*-" for c in pattern):
        raise _refuse(kind, f"recurrent layers (hybrid_override_pattern {pattern!r})")


def _expected_window(config, layer: int) -> int | None:
    """The sliding window the config gives ``layer`` (None: full attention), to cross-check the calls."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and layer < len(types):
        return int(window) if types[layer] in ("sliding_attention", "local") else None
    return int(window)


class Probe:
    """The scratch of one forward (``medusa_kv``, ``attention_scratch``): the attention function records each call here."""

    def __init__(self):
        self.calls: list[tuple[torch.nn.Module, tuple[int, ...], tuple[int, ...], dict]] = []


def record_call(probe: Probe, module, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The attention function's probe branch: record the call, return a zero output [B, T, Hq, D]."""
    probe.calls.append((module, tuple(query.shape), tuple(key.shape), dict(kwargs)))
    batch, heads, tokens, dim = query.shape
    return query.new_zeros(batch, tokens, heads, dim)


def _layer_attention(kind: str, i: int, module, kwargs: dict, head_dim: int) -> LayerAttention:
    unknown = sorted(k for k, v in kwargs.items() if k not in _BENIGN_KWARGS | _FEATURE_KWARGS and v is not None)
    if unknown:
        raise _refuse(
            kind,
            f"the attention feature {unknown[0]!r} (layer {i}), which the tree attention does not implement",
            "open an issue with the model's name",
        )
    if getattr(module, "is_causal", True) is False:
        raise _refuse(kind, f"bidirectional attention (layer {i})")
    if kwargs.get("dropout") and module.training:
        raise _refuse(kind, "attention dropout in training mode", "put the model in eval mode")
    scaling = kwargs.get("scaling")
    scale = float(scaling) if scaling is not None else head_dim**-0.5
    window = kwargs.get("sliding_window")
    window = int(window) if window and int(window) > 0 else None
    softcap = kwargs.get("softcap")
    softcap = float(softcap) if softcap else None
    sinks = kwargs.get("s_aux")
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        raise _refuse(kind, f"attention sinks of an unknown form (layer {i}: {type(sinks).__name__})", "open an issue")
    if not math.isfinite(scale) or scale <= 0:
        raise _refuse(kind, f"a softmax scale of {scale} (layer {i})", "check the model's config")
    return LayerAttention(scale=scale, window=window, softcap=softcap, sinks=sinks is not None)


def probe_attention(model, attend) -> AttentionPlan:
    """Run ``model`` (a transformers causal LM whose attention implementation routes to the tree
    attention) on two tokens with ``attend(probe)`` as its scratch (the ``medusa_kv`` keyword and
    ``attention_scratch``), and read what every layer's attention call asks for. Raises
    UnsupportedModelError on anything it cannot serve, ExporterBugError where our own code fails."""
    config = model.config
    kind = getattr(config, "model_type", type(config).__name__)
    probe = Probe()
    ids = torch.zeros((1, 2), dtype=torch.long, device=next(model.parameters()).device)
    scratch = attend(probe)
    try:
        with torch.no_grad(), attention_scratch(scratch):
            model(input_ids=ids, position_ids=torch.arange(2, device=ids.device)[None], use_cache=False, medusa_kv=scratch)
    except UnsupportedModelError:
        raise
    except Exception as exc:  # whose failure: ours is a bug to report, the model's a forward we cannot drive
        ours = _our_frame(exc, model)
        reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        if ours is not None:
            raise ExporterBugError(
                f"medusa-trt's {ours} failed on {kind} (layer {len(probe.calls)}, {reason}): this is a medusa-trt bug, please report it"
            ) from exc
        if not isinstance(exc, (TypeError, ValueError, RuntimeError, AttributeError, NotImplementedError)):
            raise
        raise _refuse(kind, f"a forward the tree attention cannot drive ({reason})", "open an issue") from exc
    layers = getattr(config, "num_hidden_layers", None)
    if not probe.calls:
        raise _no_attention_calls(kind, model)
    if layers is not None and len(probe.calls) != layers:
        raise _refuse(kind, f"{len(probe.calls)} attention calls for {layers} layers (recurrent, linear-attention or shared layers)")
    _, q_shape, k_shape, _ = probe.calls[0]
    num_q, head_dim, num_kv = q_shape[1], q_shape[3], k_shape[1]
    plan = []
    for i, (module, q, k, kwargs) in enumerate(probe.calls):
        if (q[1], q[3], k[1], k[3]) != (num_q, head_dim, num_kv, head_dim):
            raise _refuse(
                kind, f"layers of different attention shapes (layer {i}: {q[1]}/{k[1]} heads of {k[3]} vs {num_q}/{num_kv} of {head_dim})"
            )
        if num_q % num_kv:
            raise _refuse(kind, f"{num_q} query heads over {num_kv} key/value heads (not a whole multiple)")
        layer = _layer_attention(kind, i, module, kwargs, head_dim)
        expected = _expected_window(config, i)
        if expected != layer.window:
            raise _refuse(
                kind,
                f"a sliding window of {expected} in its config for layer {i}, which its attention call gives as {layer.window}",
                "open an issue with the model's name",
            )
        plan.append(layer)
    return AttentionPlan(kind, tuple(plan), num_q, num_kv, head_dim)


# where this project's code lies (the repository root is the package: its .venv and build/ are not ours)
_PACKAGE = Path(__file__).resolve().parents[1]
_OUR_CODE = tuple(_PACKAGE / name for name in ("exporter", "plugins", "runtime"))
_OUR_PARTS = {"exporter/wrapper.py": "tree attention", "exporter/architecture.py": "attention probe", "exporter/experts.py": "experts"}


def _our_frame(exc: BaseException, model) -> str | None:
    """What of ours failed in ``model``'s forward (``tree attention (exporter/wrapper.py:107 in
    _medusa_tree_attention)``); None: the model did.

    Past the frame that called the model, the innermost frame in this project's code or in the model's
    (transformers, or the folder of the model's own class: remote code) decides: a library either side
    calls (torch, a test's stand-in) fails on that caller's behalf. Our attention function runs inside the
    model's forward, so a failure in it has our frame innermost; one in the model's code has the model's."""
    import inspect
    from importlib.util import find_spec

    model_code = [Path(find_spec("transformers").origin).resolve().parent]
    try:
        model_code.append(Path(inspect.getfile(type(model))).resolve().parent)
    except (TypeError, OSError):  # a class without a source file (built in a REPL): transformers' frames decide
        pass
    tb, innermost = exc.__traceback__.tb_next, None  # the first frame is the caller's (probe_attention)
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename).resolve()
        if any(path.is_relative_to(root) for root in model_code):
            innermost = None
        elif any(path.is_relative_to(root) for root in _OUR_CODE):
            innermost = (path, tb.tb_lineno, tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    if innermost is None:
        return None
    path, line, function = innermost
    where = path.relative_to(_PACKAGE)
    what = _OUR_PARTS.get(where.as_posix(), "tree attention" if where.parts[0] == "plugins" else "export wrapper")
    return f"{what} ({where}:{line} in {function})"


def _no_attention_calls(kind: str, model) -> UnsupportedModelError:
    """Why no layer of ``model`` reached the attention interface, named from its modules."""
    inline = sorted({type(m).__name__ for m in model.modules() if "attention" in type(m).__name__.lower()})
    if not inline:
        return _refuse(
            kind, "no layer that attends through transformers' attention interface (no attention modules: recurrent or state-space)"
        )
    return UnsupportedModelError(
        f"model architecture {kind!r} computes attention inside its own modules ({', '.join(inline[:3])}), not through "
        "transformers' AttentionInterface, so the tree attention cannot take its place: open an issue with the model's name"
    )
