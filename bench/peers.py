"""Peer engines for ``medusa-bench --peer``: another inference engine decoding the same prompt token
ids, greedily, with the same threads, interleaved with this project's rows.

``llama.cpp:FILE.gguf`` runs llama.cpp through its Python binding (the ``llama-cpp-python`` package,
built from source where no wheel fits: ``make peers``); ``llama.cpp+lookup:FILE.gguf`` adds its
prompt-lookup decoding (``LlamaPromptLookupDecoding``), llama.cpp's own draft-free speculation. The
model file must hold the same vocabulary as the engine (a GGUF of the same model), so that the token
ids mean the same and the outputs can be compared token for token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from medusa_trt.runtime.errors import MedusaError

KINDS = ("llama.cpp", "llama.cpp+lookup")
LOOKUP_TOKENS = 10  # tokens llama.cpp's prompt lookup drafts per step (its own default)
INSTALL = "pip install llama-cpp-python (it builds llama.cpp from source where no wheel fits; make peers does it)"


class PeerError(MedusaError):
    """A --peer cannot run; the message says why and what to do."""


class Peer(Protocol):
    name: str  # the row's name in the report

    def generate(self, prompt: list[int], max_new_tokens: int, eos: frozenset[int]) -> tuple[list[int], float]:
        """Greedy continuation of ``prompt`` (token ids): (new token ids, seconds), EOS excluded and ending it."""
        ...


@dataclass(frozen=True)
class PeerSpec:
    kind: str  # one of KINDS
    path: Path  # the GGUF file

    @property
    def name(self) -> str:
        return f"{self.kind}[{self.path.stem}]"


def parse_peer(text: str) -> PeerSpec:
    """``KIND:FILE`` (``llama.cpp:model.gguf``), checked before any engine loads."""
    kind, sep, file = text.partition(":")
    if not sep or kind not in KINDS or not file:
        raise PeerError(f"--peer {text!r}: write KIND:FILE.gguf with KIND one of {', '.join(KINDS)} (llama.cpp:model.gguf)")
    path = Path(file)
    if not path.is_file():
        raise PeerError(f"--peer {text}: {path} does not exist: pass a GGUF file of the engine's model")
    if path.suffix != ".gguf":
        raise PeerError(f"--peer {text}: {path} is not a .gguf file: llama.cpp reads GGUF models")
    return PeerSpec(kind, path)


def binding_missing() -> str | None:
    """Why llama.cpp's Python binding cannot be imported here (None when it can)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:  # not installed, or built without its shared library
        return f"llama-cpp-python is not importable ({exc}): {INSTALL}"
    except OSError as exc:  # the package is there but its libllama cannot be loaded
        return f"llama-cpp-python's library cannot be loaded ({exc}): reinstall it ({INSTALL})"
    return None


class LlamaCppPeer:
    """llama.cpp on one GGUF file: one context of ``context`` tokens, ``threads`` threads for
    prompt and decode alike, greedy sampling (temperature 0, no repetition penalty)."""

    def __init__(self, spec: PeerSpec, *, threads: int | None, context: int, lookup_tokens: int = LOOKUP_TOKENS):
        missing = binding_missing()
        if missing:
            raise PeerError(f"--peer {spec.kind}:{spec.path}: {missing}")
        from llama_cpp import Llama

        draft = None
        if spec.kind == "llama.cpp+lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
        self.name, self.spec = spec.name, spec
        # prompt lookup evaluates the last token and up to lookup_tokens drafts at once: room for them past the context.
        # It reads every position's logits, which the binding keeps in a buffer of n_batch rows unless logits_all is
        # asked for when the context is made (0.3.x): without it, a sequence past 512 tokens overflows that buffer
        context += lookup_tokens + 1 if draft is not None else 0
        try:
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
            raise PeerError(f"--peer {spec.kind}:{spec.path}: llama.cpp cannot load it ({exc}): pass a GGUF model file") from exc
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


def make_peer(spec: PeerSpec, *, threads: int | None, context: int, vocab_size: int) -> Peer:
    """A ready peer whose vocabulary matches the engine's (its token ids then mean the same)."""
    peer = LlamaCppPeer(spec, threads=threads, context=context)
    if peer.vocab_size != vocab_size:
        raise PeerError(
            f"--peer {spec.kind}:{spec.path} has a vocabulary of {peer.vocab_size} tokens, the engine {vocab_size}: "
            "pass a GGUF of the engine's model"
        )
    return peer
