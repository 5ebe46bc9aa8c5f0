"""Peer engines for ``medusa-bench --peer``: another inference engine decoding the same prompt token
ids, greedily, with the same threads, interleaved with this project's rows. Each runs in a process of
its own (bench/peer_process.py): a crash inside one (a segfault in llama.cpp) costs its row only.

``KIND:PATH``, KIND one of ``KINDS``:

* ``llama.cpp:FILE.gguf`` runs llama.cpp through its Python binding (the ``llama-cpp-python`` package,
  built from source where no wheel fits: ``make peers``); ``+lookup`` adds its prompt-lookup decoding
  (``LlamaPromptLookupDecoding``), llama.cpp's own draft-free speculation. ``llama.cpp-norepack``
  loads the model with the binding's ``use_extra_bufts`` off: no extra buffer types (AMX, repacked
  weights), whose decode segfaults on some CPUs. The file must hold the engine's vocabulary
  (a GGUF of the same model), so that the token ids mean the same and outputs compare token for token.
* ``openvino:DIR`` runs OpenVINO GenAI's ``LLMPipeline`` on a folder ``optimum-cli export openvino``
  wrote (scripts/openvino_models.py makes the demo model's), in f32 inference precision (exact:
  weights as the folder stores them, activations in f32); ``openvino-default`` in the CPU's own
  default precision (bf16 where the CPU has AMX or AVX512-BF16: not exact); ``+lookup`` adds its
  prompt-lookup decoding.

Every row reports the mode that ran (``Peer.mode``).
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from medusa_trt.runtime.errors import MedusaError

LOOKUP_TOKENS = 10  # tokens llama.cpp's prompt lookup drafts per step (its own default)
OV_LOOKUP_TOKENS = 5  # OpenVINO GenAI's prompt lookup: num_assistant_tokens (its samples' value)
OV_LOOKUP_NGRAM = 3  # ... and max_ngram_size (its samples' value)
LLAMA_INSTALL = "pip install llama-cpp-python (it builds llama.cpp from source where no wheel fits; make peers does it)"
OPENVINO_INSTALL = "pip install -c constraints.txt '.[openvino]' (make openvino-peer)"
MORE_KINDS = "MEDUSA_TRT_PEER_KINDS"  # a module whose KINDS --peer accepts too (the tests' doubles: tests/peer_doubles.py)


class PeerError(MedusaError):
    """A --peer cannot run; the message says why and what to do."""


class Peer(Protocol):
    vocab_size: int
    mode: str  # what ran, for the row: "extra buffer types on", "f32 precision (hint)", ...

    def generate(self, prompt: list[int], max_new_tokens: int, eos: frozenset[int]) -> tuple[list[int], float]:
        """Greedy continuation of ``prompt`` (token ids): (new token ids, seconds), EOS excluded and ending it."""
        ...


@dataclass(frozen=True)
class Runtime:
    """One engine a peer runs on: what it reads, how to tell it is not installed, how to load it."""

    name: str
    reads: str  # what the path names, for messages: "FILE.gguf", "DIR"
    model: str  # what the path holds, for messages: "a GGUF", "an OpenVINO folder"
    missing: Callable[[], str | None]  # why its package cannot be imported here (None when it can)
    check: Callable[[str, Path], None]  # raises PeerError where the path cannot be this runtime's model
    load: Callable[..., Peer]  # (spec, threads=, context=, **kind.options) -> a ready Peer


@dataclass(frozen=True)
class PeerKind:
    name: str  # what --peer writes before the colon
    runtime: Runtime
    options: dict = field(default_factory=dict)  # keyword arguments of runtime.load: lookup, extra_bufts, precision


@dataclass(frozen=True)
class PeerSpec:
    kind: PeerKind
    path: Path  # the model: a GGUF file, an OpenVINO folder

    @property
    def name(self) -> str:
        """The row's name in the report."""
        return f"{self.kind.name}[{self.path.name if self.path.is_dir() else self.path.stem}]"

    @property
    def text(self) -> str:
        return f"{self.kind.name}:{self.path}"


# ----------------------------------------------------------------- llama.cpp


def llama_missing() -> str | None:
    """Why llama.cpp's Python binding cannot be imported here (None when it can)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:  # not installed, or built without its shared library
        return f"llama-cpp-python is not importable ({exc}): {LLAMA_INSTALL}"
    except OSError as exc:  # the package is there but its libllama cannot be loaded
        return f"llama-cpp-python's library cannot be loaded ({exc}): reinstall it ({LLAMA_INSTALL})"
    return None


binding_missing = llama_missing  # the name tests and callers used before OpenVINO joined


def _check_gguf(text: str, path: Path) -> None:
    if not path.is_file():
        raise PeerError(f"--peer {text}: {path} does not exist: pass a GGUF file of the engine's model")
    if path.suffix != ".gguf":
        raise PeerError(f"--peer {text}: {path} is not a .gguf file: llama.cpp reads GGUF models")


class NoExtraBuffers:
    """While open, the binding's default model parameters have ``use_extra_bufts`` off: ``Llama``
    reads them when it loads the model and offers no argument of its own for it (0.3.x)."""

    def __init__(self, text: str):
        import llama_cpp.llama_cpp as native

        fields = {name for name, _ in native.llama_model_params._fields_}
        if "use_extra_bufts" not in fields:
            raise PeerError(
                f"--peer {text}: this llama-cpp-python has no use_extra_bufts model parameter (its llama.cpp predates it): "
                "use llama.cpp:, or install a newer binding (make peers)"
            )
        self.native, self.original = native, native.llama_model_default_params

    def __enter__(self):
        def defaults():
            params = self.original()
            params.use_extra_bufts = False
            return params

        self.native.llama_model_default_params = defaults  # this process is the peer's own: no one else reads it

    def __exit__(self, *exc):
        self.native.llama_model_default_params = self.original


class LlamaCppPeer:
    """llama.cpp on one GGUF file: one context of ``context`` tokens, ``threads`` threads for
    prompt and decode alike, greedy sampling (temperature 0, no repetition penalty)."""

    def __init__(self, spec: PeerSpec, *, threads: int | None, context: int, lookup: bool = False, extra_bufts: bool = True):
        import contextlib

        from llama_cpp import Llama

        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
        self.spec = spec
        self.mode = f"extra buffer types {'on' if extra_bufts else 'off'}" + (f", lookup {LOOKUP_TOKENS}" if lookup else "")
        # prompt lookup evaluates the last token and up to LOOKUP_TOKENS drafts at once: room for them past the context.
        # It reads every position's logits, which the binding keeps in a buffer of n_batch rows unless logits_all is
        # asked for when the context is made (0.3.x): without it, a sequence past 512 tokens overflows that buffer
        context += LOOKUP_TOKENS + 1 if draft is not None else 0
        try:
            with contextlib.nullcontext() if extra_bufts else NoExtraBuffers(spec.text):
                self.llm = Llama(
                    model_path=str(spec.path),
                    n_ctx=context,
                    n_threads=threads,
                    n_threads_batch=threads,
                    n_batch=512,
                    draft_model=draft,
                    logits_all=draft is not None,
                    verbose=False,
                    seed=0,
                )
        except (ValueError, RuntimeError) as exc:  # a file llama.cpp cannot load
            raise PeerError(f"--peer {spec.text}: llama.cpp cannot load it ({exc}): pass a GGUF model file") from exc
        self.vocab_size = self.llm.n_vocab()

    def generate(self, prompt: list[int], max_new_tokens: int, eos: frozenset[int]) -> tuple[list[int], float]:
        out: list[int] = []
        start = time.perf_counter()
        for token in self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if token in eos or self.llm.token_eos() == token:
                break
            out.append(int(token))
            if len(out) == max_new_tokens:
                break
        return out, time.perf_counter() - start


# ----------------------------------------------------------------- OpenVINO GenAI

OV_MODEL = "openvino_model.xml"  # what optimum-cli export openvino writes for the language model


def openvino_missing() -> str | None:
    """Why OpenVINO GenAI cannot be imported here (None when it can)."""
    try:
        import openvino  # noqa: F401
        import openvino_genai  # noqa: F401
    except ImportError as exc:  # not installed, or a mismatched openvino / openvino-genai pair
        return f"OpenVINO GenAI is not importable ({exc}): {OPENVINO_INSTALL}"
    return None


def _check_openvino_dir(text: str, path: Path) -> None:
    if not path.is_dir():
        raise PeerError(
            f"--peer {text}: {path} is not a folder: pass an OpenVINO model folder (scripts/openvino_models.py makes the demo model's)"
        )
    if not (path / OV_MODEL).is_file():
        raise PeerError(f"--peer {text}: {path} holds no {OV_MODEL}: pass a folder optimum-cli export openvino wrote")


class OpenVINOPeer:
    """OpenVINO GenAI's ``LLMPipeline`` on one exported folder, on the CPU: ``threads`` inference
    threads, greedy decoding, the prompt given as token ids (``TokenizedInputs``: no chat template,
    no tokenizer of its own in the way)."""

    def __init__(self, spec: PeerSpec, *, threads: int | None, context: int, lookup: bool = False, precision: str | None = "f32"):
        import openvino as ov
        import openvino_genai as ovg

        self.ov, self.ovg, self.spec, self.lookup = ov, ovg, spec, lookup
        properties: dict = {"INFERENCE_NUM_THREADS": threads} if threads else {}
        if precision is not None:
            properties["INFERENCE_PRECISION_HINT"] = precision
        if lookup:
            properties["prompt_lookup"] = True
        try:
            self.pipe = ovg.LLMPipeline(str(spec.path), "CPU", **properties)
        except RuntimeError as exc:  # a folder OpenVINO cannot read (its message is long: the first line says it)
            raise PeerError(f"--peer {spec.text}: OpenVINO cannot load it ({str(exc).strip().splitlines()[0]})") from exc
        ran = precision or f"{_default_precision(ov)} (the CPU's default)"
        self.mode = f"{ran} precision" + (f", lookup {OV_LOOKUP_TOKENS}/{OV_LOOKUP_NGRAM}-gram" if lookup else "")
        self.vocab_size = _vocab_size(spec)

    def generate(self, prompt: list[int], max_new_tokens: int, eos: frozenset[int]) -> tuple[list[int], float]:
        import numpy as np

        config = self.ovg.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        config.do_sample = False
        config.repetition_penalty = 1.0
        config.stop_token_ids = set(eos)
        if self.lookup:
            config.num_assistant_tokens = OV_LOOKUP_TOKENS
            config.max_ngram_size = OV_LOOKUP_NGRAM
        ids = np.asarray([prompt], dtype=np.int64)  # (1, T)
        inputs = self.ovg.TokenizedInputs(self.ov.Tensor(ids), self.ov.Tensor(np.ones_like(ids)))
        start = time.perf_counter()
        result = self.pipe.generate(inputs, config)
        seconds = time.perf_counter() - start
        out: list[int] = []
        for token in result.tokens[0]:
            if token in eos:
                break
            out.append(int(token))
        return out[:max_new_tokens], seconds


def _default_precision(ov) -> str:
    """The inference precision OpenVINO's CPU plugin picks on this CPU without a hint (bf16 with AMX / AVX512-BF16)."""
    name = str(ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT")).removeprefix("<Type: '").removesuffix("'>")
    return {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}.get(name, name)


def _vocab_size(spec: PeerSpec) -> int:
    """The model's vocabulary size, from the config.json beside the OpenVINO model."""
    config = spec.path / "config.json"
    try:
        return int(json.loads(config.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PeerError(f"--peer {spec.text}: cannot read vocab_size from {config} ({exc}): pass a folder optimum-cli wrote") from exc


# ----------------------------------------------------------------- the kinds


LLAMA_CPP = Runtime("llama.cpp", "FILE.gguf", "a GGUF", llama_missing, _check_gguf, LlamaCppPeer)
OPENVINO = Runtime("openvino", "DIR", "an OpenVINO folder", openvino_missing, _check_openvino_dir, OpenVINOPeer)

KINDS = {
    k.name: k
    for k in (
        PeerKind("llama.cpp", LLAMA_CPP),
        PeerKind("llama.cpp+lookup", LLAMA_CPP, {"lookup": True}),
        PeerKind("llama.cpp-norepack", LLAMA_CPP, {"extra_bufts": False}),
        PeerKind("llama.cpp-norepack+lookup", LLAMA_CPP, {"extra_bufts": False, "lookup": True}),
        PeerKind("openvino", OPENVINO),
        PeerKind("openvino+lookup", OPENVINO, {"lookup": True}),
        PeerKind("openvino-default", OPENVINO, {"precision": None}),
        PeerKind("openvino-default+lookup", OPENVINO, {"precision": None, "lookup": True}),
    )
}


def _kinds() -> dict[str, PeerKind]:
    """The kinds --peer accepts here: KINDS, and those of the module MEDUSA_TRT_PEER_KINDS names (importable
    in the peers' processes too: they start with this process's sys.path and environment)."""
    module = os.environ.get(MORE_KINDS)
    return KINDS | importlib.import_module(module).KINDS if module else KINDS


def parse_peer(text: str) -> PeerSpec:
    """``KIND:PATH`` (``llama.cpp:model.gguf``, ``openvino:DIR``), checked before any engine loads."""
    kinds = _kinds()
    name, sep, path = text.partition(":")
    if not sep or name not in kinds or not path:
        by_runtime: dict[Runtime, list[str]] = {}
        for kind in KINDS.values():
            by_runtime.setdefault(kind.runtime, []).append(kind.name)
        forms = "; or ".join(f"KIND:{r.reads} with KIND one of {', '.join(names)}" for r, names in by_runtime.items())
        raise PeerError(f"--peer {text!r}: write {forms}")
    kind = kinds[name]
    kind.runtime.check(text, Path(path))
    return PeerSpec(kind, Path(path))


def peer_missing(spec: PeerSpec) -> str | None:
    """Why ``spec``'s runtime cannot be imported here (None when it can)."""
    return spec.kind.runtime.missing()


def load_peer(spec: PeerSpec, *, threads: int | None, context: int) -> Peer:
    """The peer itself, in this process (bench/peer_process.py calls it in the peer's own); ``PeerError``
    where its runtime cannot be imported here."""
    missing = peer_missing(spec)
    if missing:
        raise PeerError(f"--peer {spec.text}: {missing}")
    return spec.kind.runtime.load(spec, threads=threads, context=context, **spec.kind.options)


def make_peer(spec: PeerSpec, *, threads: int | None, context: int, vocab_size: int) -> Peer:
    """A ready peer, in this process, whose vocabulary matches the engine's (its token ids then mean the same)."""
    peer = load_peer(spec, threads=threads, context=context)
    check_vocab(spec, peer.vocab_size, vocab_size)
    return peer


def check_vocab(spec: PeerSpec, peer_vocab: int, vocab_size: int) -> None:
    if peer_vocab != vocab_size:
        raise PeerError(
            f"--peer {spec.text} has a vocabulary of {peer_vocab} tokens, the engine {vocab_size}: "
            f"pass {spec.kind.runtime.model} of the engine's model"
        )
