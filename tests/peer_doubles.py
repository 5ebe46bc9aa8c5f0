"""Test doubles of ``medusa-bench --peer`` engines, for tests/test_peer_process.py: with
``MEDUSA_TRT_PEER_KINDS=peer_doubles`` (tests/ is on the path of the peers' processes too), ``--peer``
also takes ``scripted:FILE.json``, a peer that replays the script in FILE:

    {"tokens": [5, 6, 7], "vocab_size": 512, "die_on_call": 2, "signal": "SIGSEGV", "raise_on_call": null,
     "die_loading": false}

It answers every prompt with ``tokens`` (cut to max_new_tokens); on its ``die_on_call``-th call to
``generate`` (the warm-up is the first) it kills its own process with ``signal``, as llama.cpp's decode
does on some CPUs; on its ``raise_on_call``-th it raises; with ``die_loading`` it dies while loading.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from medusa_trt.bench.peers import PeerError, PeerKind, Runtime


def _never_missing() -> str | None:
    return None


def _check_script(text: str, path: Path) -> None:
    if not path.is_file():
        raise PeerError(f"--peer {text}: {path} does not exist: pass a script file")


class ScriptedPeer:
    def __init__(self, spec, *, threads: int | None, context: int):
        self.script = json.loads(spec.path.read_text())
        self.vocab_size = self.script.get("vocab_size", 512)
        self.mode = f"scripted, {threads} threads"
        self.calls = 0
        if self.script.get("die_loading"):
            os.kill(os.getpid(), signal.Signals[self.script.get("signal", "SIGSEGV")])

    def generate(self, prompt: list[int], max_new_tokens: int, eos: frozenset[int]) -> tuple[list[int], float]:
        self.calls += 1
        if self.calls == self.script.get("die_on_call"):
            os.kill(os.getpid(), signal.Signals[self.script.get("signal", "SIGSEGV")])
            time.sleep(10)  # the signal is delivered before this returns
        if self.calls == self.script.get("raise_on_call"):
            raise RuntimeError("the scripted engine failed")
        return list(self.script["tokens"])[:max_new_tokens], 0.01


SCRIPTED = Runtime("scripted", "FILE.json", "a script", _never_missing, _check_script, ScriptedPeer)
KINDS = {"scripted": PeerKind("scripted", SCRIPTED)}
