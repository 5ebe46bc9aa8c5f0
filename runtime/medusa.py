"""``MedusaRuntime``: Medusa generation over an engine backend (ONNX Runtime, TensorRT, torch).

It owns the backend (buffers allocated once), the compiled tree and the tokenizer; the loop
itself (draft -> verify -> accept -> commit over rows that sequences join and leave) is
``scheduler.Scheduler``. ``generate`` and ``stream`` feed it prompts: when there are more prompts than
rows, a waiting prompt takes the row of a finished one between steps. Each sequence has its own
sampling parameters and seeded generator (``sampling.SamplingParams``), so a batch may mix
greedy and sampled sequences. Servers use ``batching.ContinuousBatcher`` over the same loop.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from medusa_trt.runtime.acceptance import tree_walk
from medusa_trt.runtime.config import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_CONTEXT,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_PREFILL_CHUNK,
    RuntimeConfig,
    default_tree,
    is_int,
)
from medusa_trt.runtime.drafting import CostModel, Drafting, DraftingConfig, HeadsTemplate
from medusa_trt.runtime.drafting.sequential import Expansion
from medusa_trt.runtime.engine import EngineError, EngineSource, check_tree_fits
from medusa_trt.runtime.engine_meta import precision_name
from medusa_trt.runtime.output import request_limits
from medusa_trt.runtime.results import GenerationResult, StreamEvent
from medusa_trt.runtime.sampling import broadcast_params
from medusa_trt.runtime.scheduler import Scheduler, SchedulerConfig, Seq, SeqRequest, admit
from medusa_trt.runtime.step_cost import drafting_pays
from medusa_trt.runtime.text import FileTextCodec, PromptError, TextCodec, check_messages
from medusa_trt.runtime.tree import CompiledTree, compile_tree, load_tree, resolve_tree

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class _EngineInfo:
    """What the runtime needs to know of an engine, whichever backend runs it."""

    num_heads: int
    tree: list  # default tree paths
    tree_name: str
    max_top_k: int  # most proposals per head the engine returns
    vocab_size: int  # token ids must be below it
    eos_token_ids: tuple | list
    is_chat: bool
    expansion: Expansion | None = None  # sequential heads: the template the heads call expands (None: one row per head)

    @classmethod
    def from_meta(cls, meta) -> _EngineInfo:
        """From an exported engine's ``EngineMeta`` (ONNX or TensorRT)."""
        return cls(
            num_heads=meta.num_heads,
            tree=meta.tree,
            tree_name=meta.tree_name,
            max_top_k=meta.top_k,
            vocab_size=meta.vocab_size,
            eos_token_ids=meta.eos_token_ids,
            is_chat=meta.is_chat,
            expansion=meta.expansion,
        )


def _folder_step_cost(source: EngineSource | None, backend: str) -> tuple[dict | None, float]:
    """The step-cost table an engine folder's drafting.json records and its heads call's cost,
    both relative to a one-token step ((None, 0): none, or not a folder, or measured on another backend than
    ``backend``, which then learns its own online); warns when the folder records that its verify steps are not
    its plain steps (``runtime/exactness.py``)."""
    if source is None or source.folder is None:
        return None, 0.0
    from medusa_trt.runtime.engine_folder import step_cost_table

    files, measured_on = source.files, source.folder.backend
    if measured_on != backend:
        log.info("%s's step cost was measured on %s: the drafting budget learns %s's online", files.folder, measured_on, backend)
        return None, 0.0

    raw = source.drafting
    try:
        heads = float(raw.get("heads_cost") or 0.0)
    except (TypeError, ValueError) as exc:
        raise EngineError(f"drafting.json heads_cost {raw.get('heads_cost')!r} is not a number: export the engine folder again") from exc
    exactness = raw.get("exactness")
    if isinstance(exactness, dict) and exactness.get("verify_equals_plain") is False:
        log.warning(
            "%s: drafting.json records that this engine's verify steps differ from its plain steps (max logit difference "
            "%s, measured at export): drafted output can differ from plain output. Export with the default block size "
            "or --quantize int8-channel for an exact engine",
            files.folder,
            exactness.get("max_logit_diff"),
        )
    return step_cost_table(raw.get("step_cost")), heads


class MedusaRuntime:
    """Generate with Medusa over an engine.

    ``engine``: an exported engine: a folder (``medusa-export --out DIR``; its config.json says
    ONNX Runtime or TensorRT), an ``.onnx`` file (ONNX Runtime backend) or a ``.plan`` (TensorRT),
    or a ``MedusaModel`` from ``medusa_trt.exporter.load_medusa`` (torch backend). A folder's
    ``drafting.json`` may hold a measured step-cost table: the drafting budget unless
    ``step_cost=`` says otherwise.
    """

    def __init__(self, engine, config: RuntimeConfig | None = None, *, tokenizer=None, **overrides):
        self.config = cfg = dataclasses.replace(config or RuntimeConfig(), **overrides)
        source = None  # an exported engine, read once: its files, a folder's config.json and drafting.json
        if isinstance(engine, (str, os.PathLike, EngineSource)):
            from medusa_trt.runtime.backends import backend_name

            source = EngineSource.read(engine)
            open_backend = self._tensorrt if backend_name(source, cfg.backend) == "tensorrt" else self._onnx
            self.backend, codec, info = open_backend(source, cfg)
        elif hasattr(engine, "kv_spec") and hasattr(engine, "propose"):
            self.backend, codec, info = self._torch(engine, cfg)
        else:
            raise EngineError(
                f"unsupported engine {type(engine).__name__}: "
                "pass an .onnx engine path or a MedusaModel from medusa_trt.exporter.load_medusa"
            )
        self.max_batch, self.max_context = self.backend.max_batch, self.backend.max_context
        self._folder_step_cost, self._heads_cost = _folder_step_cost(source, self.backend.name)
        self.num_heads = info.num_heads
        if cfg.tree is not None:
            self.tree: CompiledTree = load_tree(cfg.tree, max_depth=self.num_heads)
        else:
            self.tree = compile_tree(info.tree, name=info.tree_name, max_depth=self.num_heads)
        expanded = self.backend.expand(self.tree.paths, self.tree.top_k)  # torch backend, sequential heads: this tree
        if expanded is not None:
            info = dataclasses.replace(info, expansion=expanded, max_top_k=self.tree.top_k)
        self._info = info
        self._check_tree(self.tree)
        self.drafting = self._drafting(self.tree, cfg.drafters, explicit_tree=cfg.tree is not None)
        limit = self.backend.max_tokens
        if cfg.prefill_chunk is None:  # the default fits any engine
            self.config = cfg = dataclasses.replace(cfg, prefill_chunk=min(DEFAULT_PREFILL_CHUNK, limit or DEFAULT_PREFILL_CHUNK))
        elif limit is not None and min(cfg.prefill_chunk, self.max_context) > limit:
            raise EngineError(f"prefill_chunk {cfg.prefill_chunk} exceeds the engine's {limit} tokens per step: lower it")
        self.codec = TextCodec(tokenizer) if tokenizer is not None else codec
        self.eos = frozenset(int(i) for i in info.eos_token_ids)
        self.is_chat = bool(info.is_chat) and self.codec.has_chat_template
        self._lock = threading.Lock()  # shared by with_tree copies: they share the KV cache

    def _drafting(self, tree: CompiledTree, names, *, explicit_tree: bool, available_only: bool = False) -> Drafting:
        """The drafter set: ``names``, or by default every drafter the engine supports, unless no tree
        of theirs can beat plain decoding at the measured step cost; an explicit ``chain-0`` heads
        template with the default set keeps its old meaning, plain decoding."""
        step_cost = self.config.step_cost or self._folder_step_cost
        config = DraftingConfig() if step_cost is None else DraftingConfig(cost=CostModel(dict(step_cost)), learn_cost=False)
        template = HeadsTemplate(tree, tree_walk(tree), self._info.expansion) if self.num_heads and tree.depth_max else None

        def drafting(names) -> Drafting:
            limit, heads_cost = self.backend.max_tokens, self._heads_cost
            return Drafting(names, template, config, engine_max_nodes=limit, heads_cost=heads_cost, available_only=available_only)

        if names is not None:
            return drafting(tuple(names))
        if explicit_tree and tree.depth_max == 0:
            return drafting(())
        every = drafting(None)
        if every.names and not drafting_pays(config.cost, every.fixed_cost, every.max_nodes, every.max_depth):
            log.warning(
                "no tree can beat plain decoding on this engine's measured step cost (%s, heads call %.2f): "
                "default drafting is plain decoding here",
                step_cost,
                every.fixed_cost,
            )
            return drafting(())
        return every

    def with_tree(self, tree) -> MedusaRuntime:
        """The same engine and buffers with another heads template (the drafters stay, less those the
        new template cannot run; ``chain-0`` with the default drafters is plain decoding). Not for
        concurrent use beside the original: they share the KV cache."""
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, tree=tree)
        other.tree = load_tree(tree, max_depth=self.num_heads)
        self._check_tree(other.tree)
        other.drafting = other._drafting(other.tree, self.config.drafters, explicit_tree=True, available_only=True)
        return other

    def with_drafters(self, drafters) -> MedusaRuntime:
        """The same engine and buffers with another drafter set (``()``: plain decoding)."""
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, drafters=drafters)
        other.drafting = other._drafting(other.tree, other.config.drafters, explicit_tree=other.config.tree is not None)
        return other

    def describe(self) -> str:
        """What runs: the backend with its threads and instruction set, and the engine's precision
        (``native (avx512_vnni, 2 threads), int8-channel``: the quantization, else the dtype; a torch model has none)."""
        meta = getattr(self.backend, "meta", None)
        return self.backend.describe() + ("" if meta is None else f", {precision_name(meta.dtype, meta.quantization)}")

    def plain(self) -> MedusaRuntime:
        """Plain decoding on the same engine: no drafts, one token per step."""
        return self.with_drafters(())

    def _check_tree(self, tree: CompiledTree) -> None:
        check_tree_fits(tree, top_k=self._info.max_top_k, max_tokens=self.backend.max_tokens)

    @staticmethod
    def _onnx(path, cfg: RuntimeConfig):
        from medusa_trt.runtime.backends import open_onnx_backend

        backend = open_onnx_backend(path, cfg)  # onnxruntime or openvino (cfg.backend, else the engine folder's choice)
        return backend, FileTextCodec(backend.files.tokenizer), _EngineInfo.from_meta(backend.meta)

    @staticmethod
    def _tensorrt(path, cfg: RuntimeConfig):
        from medusa_trt.runtime.backends.tensorrt_backend import TensorRTBackend  # tensorrt and torch only on this path

        backend = TensorRTBackend(
            path, max_batch=cfg.max_batch, max_context=cfg.max_context, cuda_graph=cfg.cuda_graph, checksums=cfg.verify_checksums
        )
        return backend, FileTextCodec(backend.files.tokenizer), _EngineInfo.from_meta(backend.meta)

    @staticmethod
    def _torch(model, cfg: RuntimeConfig):
        from medusa_trt.runtime.backends.torch_backend import TorchBackend  # torch only on this path

        positions = getattr(model, "max_positions", None)
        max_context = cfg.max_context or min(DEFAULT_MAX_CONTEXT, positions or DEFAULT_MAX_CONTEXT)
        if positions is not None and max_context > positions:
            raise EngineError(f"max_context {max_context} exceeds the model's {positions} positions: lower max_context")
        backend = TorchBackend(
            model, max_batch=cfg.max_batch or DEFAULT_MAX_BATCH, max_context=max_context, device=cfg.device, cuda_graph=cfg.cuda_graph
        )
        name, paths = resolve_tree(getattr(model, "tree", None) or default_tree(model.num_heads))  # the heads' own, else a chain
        info = _EngineInfo(
            num_heads=model.num_heads,
            tree=paths,
            tree_name=name,
            max_top_k=model.vocab_size,  # the torch heads rank the whole vocabulary: any top-k up to it
            vocab_size=model.vocab_size,
            eos_token_ids=model.eos_token_ids,
            is_chat=getattr(model, "is_chat", False),
        )
        return backend, TextCodec(model.tokenizer), info

    # ----------------------------------------------------------------- public API

    def generate(self, prompts, **options):
        """One ``GenerationResult`` for a single prompt, a list for a batch. A prompt is text (the chat
        template applied for instruct engines), a list of token ids, or a conversation: a list of
        {"role": "system" | "user" | "assistant", "content": text} dicts rendered by the engine's
        chat template, ready for the assistant's reply (multi-turn chat).

        Options (keywords, the same for ``completed`` and ``stream``): ``max_new_tokens`` (default
        ``DEFAULT_MAX_NEW_TOKENS``); ``stop``, a stop string or a list of them; ``chat_template``
        (None: the engine's default). Sampling (see ``SamplingParams``): ``temperature`` 0 (default)
        decodes greedily; above 0 the default ``acceptance`` is ``"lossless"`` (exactly the base
        model's distribution after temperature / ``top_k`` / ``top_p``); ``"typical"`` accepts more
        but is not exact. Each of temperature, top_p, top_k, seed, acceptance is one value for all
        prompts or a list with one per prompt; or pass ``sampling=`` SamplingParams (one or a list).
        ``hidden=True`` (not for ``stream``) also returns the heads' input hidden state before every
        new token (``GenerationResult.hidden``)."""
        single, seqs = self._sequences(prompts, **options)
        for _ in self._run(seqs):
            pass
        results = [s.result() for s in seqs]
        return results[0] if single else results

    def completed(self, prompts, **options) -> Iterator[tuple[int, GenerationResult]]:
        """(prompt index, result) for each prompt of a list as soon as it finishes, in the order
        they finish (options as ``generate``): rows free up and refill without waiting for the
        slowest of a batch, and a caller can store each result at once (self-distillation)."""
        _, seqs = self._sequences(prompts, **options)  # checked here, at the call: not at the first next()
        return ((e.index, seqs[e.index].result()) for e in self._run(seqs) if e.finish_reason is not None)

    def stream(self, prompts, **options) -> Iterator[StreamEvent]:
        """Yield tokens as they are committed, one event per sequence and step (options as ``generate``);
        ``event.index`` is the prompt's position, ``event.finish_reason`` is set on its last event."""
        _, seqs = self._sequences(prompts, hidden=False, **options)  # events carry no hidden states: hidden= is refused
        return self._run(seqs)  # options and prompts checked at the call, not at the first next()

    def scheduler(self) -> Scheduler:
        """A fresh loop over this runtime's engine, drafters and tokenizer (the caller holds ``engine_lock``)."""
        config = SchedulerConfig(self.max_batch, self.max_context, self.config.prefill_chunk, self.eos)
        return Scheduler(self.backend, self.drafting, self.codec, config)

    def _run(self, seqs: list[Seq]) -> Iterator[StreamEvent]:
        """Continuous batching over the prompts: waiting prompts join in waves, when half the rows
        (or enough for all that wait) are free (``scheduler.admit``)."""
        with self.engine_lock():
            scheduler, waiting = self.scheduler(), deque(seqs)
            wave = max(1, self.max_batch // 2)
            while waiting or scheduler.active:
                joining = admit(waiting, scheduler.free, wave)
                if joining:
                    scheduler.add(joining)
                for _, event in scheduler.step():
                    yield event

    @contextlib.contextmanager
    def engine_lock(self):
        """Exclusive use of the engine and its KV cache (shared with ``with_tree`` copies): one
        loop at a time. Concurrent requests go through one ``ContinuousBatcher`` instead."""
        if not self._lock.acquire(blocking=False):
            raise EngineError(
                "this runtime's engine is already generating (another thread, stream or ContinuousBatcher): "
                "send concurrent requests through one ContinuousBatcher, or give each thread its own MedusaRuntime"
            )
        try:
            yield
        finally:
            self._lock.release()

    def _sequences(
        self,
        prompts,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        stop: str | Sequence[str] | None = None,
        chat_template: bool | None = None,
        temperature=None,
        top_p=None,
        top_k=None,
        seed=None,
        acceptance=None,
        sampling=None,
        hidden: bool = False,
    ) -> tuple[bool, list[Seq]]:
        """The options of ``generate``, ``completed`` and ``stream`` (defined here once), checked: (single prompt?, sequences)."""
        stops = request_limits(max_new_tokens, stop)
        single, batch = self.encode_prompts(prompts, chat_template)
        params = broadcast_params(len(batch), sampling, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, acceptance=acceptance)
        return single, [Seq(SeqRequest(i, ids, max_new_tokens, stops, p, hidden=hidden)) for i, (ids, p) in enumerate(zip(batch, params))]

    # ----------------------------------------------------------------- inputs

    def encode_prompts(self, prompts, chat_template: bool | None = None) -> tuple[bool, list[list[int]]]:
        """(single prompt?, token ids per prompt) for what ``generate`` takes, checked at the door (text,
        or token ids of the right type and range): a bad one raises ``PromptError`` here and never
        reaches the engine (``ContinuousBatcher`` encodes its requests with it)."""
        if chat_template is not None and not isinstance(chat_template, bool):
            raise PromptError(f"chat_template must be True, False or None, got {chat_template!r}")
        chat = self.is_chat if chat_template is None else chat_template
        if chat and not self.codec.has_chat_template:
            raise PromptError("chat_template=True but the tokenizer has no chat template")
        if isinstance(prompts, (bytes, bytearray, memoryview)):
            raise PromptError("prompts are text (str) or lists of token ids, not bytes: decode the bytes first")
        single = (
            isinstance(prompts, str)
            or _is_conversation(prompts)
            or (
                _is_sequence(prompts)
                and len(prompts) > 0
                and not any(isinstance(t, (str, bytes, dict)) or _is_sequence(t) for t in prompts)
            )
        )
        items = [prompts] if single else list(prompts) if _is_sequence(prompts) else None
        if not items:
            raise PromptError("no prompts given: pass a string, a list of token ids, a conversation, or a list of those")
        batch = []
        for i, item in enumerate(items):
            if _is_conversation(item):
                ids = self._conversation(i, item, chat_template)
            elif isinstance(item, str):
                ids = self.codec.encode(item, chat=chat)
            else:
                ids = self._token_ids(i, item)
            if not ids:
                raise PromptError(f"prompt {i} is empty: pass some text or token ids")
            if len(ids) + 1 > self.max_context:
                raise PromptError(
                    f"prompt {i} has {len(ids)} tokens but max_context is {self.max_context} "
                    "(room for at least one new token is needed): shorten the prompt or raise max_context"
                )
            batch.append(ids)
        return single, batch

    def _conversation(self, i: int, messages, chat_template: bool | None) -> list[int]:
        """A conversation prompt (system / user / assistant turns) through the engine's chat template."""
        if chat_template is False:
            raise PromptError(f"prompt {i} is a conversation, which only the chat template can render: drop chat_template=False")
        if not self.codec.has_chat_template:
            raise PromptError(
                f"prompt {i} is a conversation but this engine's tokenizer has no chat template: pass text or token ids, "
                "or put the model's chat_template.jinja in the engine's tokenizer files"
            )
        return self.codec.encode_chat(check_messages(messages, f"prompt {i}"))

    def _token_ids(self, i: int, item) -> list[int]:
        vocab = self._info.vocab_size
        if isinstance(item, (bytes, bytearray, memoryview)) or not _is_sequence(item):
            raise PromptError(f"prompt {i} is a {type(item).__name__}: pass text (str) or a list of token ids")
        bad = [t for t in item if not is_int(t) or not 0 <= t < vocab][:1]
        if bad:
            bad = bad[0]
            raise PromptError(f"prompt {i} has token id {bad!r}: token ids are integers in [0, {vocab}) for this engine's vocabulary")
        return [int(t) for t in item]


def _is_conversation(x) -> bool:
    """A conversation prompt: a list of message dicts ({"role", "content"})."""
    return isinstance(x, (list, tuple)) and len(x) > 0 and isinstance(x[0], dict)


def _is_sequence(x) -> bool:
    return isinstance(x, (Sequence, np.ndarray)) and not isinstance(x, (str, bytes, bytearray, memoryview))
