"""A ``--peer`` engine in a process of its own, so that a crash inside it (llama.cpp's decode
segfaulting on some CPUs) costs its row only, not the benchmark.

    peer = PeerProcess(spec, threads=2, context=1024)    # starts the worker and loads the model there
    tokens, seconds = peer.generate(prompt, 128, eos)     # PeerDied where the worker died or failed
    peer.close()

The worker is started once per benchmark (``spawn``: a fresh interpreter, none of this process's
threads or libraries) and answers over a pipe, one request at a time:

    parent -> worker   ("generate", prompt ids, max_new_tokens, eos ids) | ("close",)
    worker -> parent   ("ready", vocab_size, mode) | ("error", message)  once, after loading
                       ("ok", token ids, seconds) | ("failed", message)    per request

``seconds`` is timed in the worker around the peer's own ``generate`` (prefill included), as the
engine rows time theirs: the pipe is not in it. A ``PeerError`` while loading (a file the runtime
cannot read) is the user's to fix and raises here; anything else while loading or generating (an
exception, a signal) ends the peer and is reported as its row's failure.
"""

from __future__ import annotations

import multiprocessing
import signal

from medusa_trt.bench.peers import PeerError, PeerSpec, check_vocab, load_peer


class PeerDied(Exception):
    """The peer's worker died (a signal, an exit) or its engine raised: the message says how."""


class PeerProcess:
    """One peer in its worker process; ``generate`` as ``peers.Peer``'s."""

    def __init__(self, spec: PeerSpec, *, threads: int | None, context: int, vocab_size: int | None = None):
        self.spec, self.name = spec, spec.name
        self.mode = ""  # the worker's Peer.mode once it is ready
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=serve, args=(child, spec, threads, context), name=f"peer {spec.name}", daemon=True)
        self._proc.start()
        child.close()  # the worker holds its end: a dead worker is then EOF here, not a hang
        reply = self._receive("loading")
        if reply[0] != "ready":
            self.close()
            raise (PeerError if reply[0] == "error" else PeerDied)(reply[1])
        _, peer_vocab, self.mode = reply
        if vocab_size is not None:
            try:
                check_vocab(spec, peer_vocab, vocab_size)
            except PeerError:
                self.close()
                raise

    def generate(self, prompt: list[int], max_new_tokens: int, eos: frozenset[int]) -> tuple[list[int], float]:
        try:
            self._conn.send(("generate", list(prompt), max_new_tokens, sorted(eos)))
        except (BrokenPipeError, ConnectionResetError, OSError):
            raise PeerDied(self._death()) from None
        reply = self._receive()
        if reply[0] == "failed":
            self.close()
            raise PeerDied(reply[1])
        return reply[1], reply[2]

    def _receive(self, doing: str = "") -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            raise PeerDied(self._death() + (f" while {doing}" if doing else "")) from None

    def _death(self) -> str:
        """How the worker ended: ``killed by SIGSEGV (signal 11)``, ``exited with code 1``."""
        self._proc.join(timeout=10)
        code = self._proc.exitcode
        if code is None:
            self._proc.kill()
            self._proc.join()
            return "stopped answering"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name} (signal {-code})"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"

    def close(self) -> None:
        """End the worker (it has ended already where it died); safe to call twice."""
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
            except OSError:
                pass
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()


def serve(conn, spec: PeerSpec, threads: int | None, context: int) -> None:
    """The worker: load the peer, then answer requests until "close" or the parent goes away."""
    try:
        peer = load_peer(spec, threads=threads, context=context)
    except PeerError as exc:
        conn.send(("error", str(exc)))
        return
    except Exception as exc:  # any other failure of a foreign engine ends the row, reported
        conn.send(("failed", f"{type(exc).__name__} while loading: {exc}"))
        return
    conn.send(("ready", peer.vocab_size, peer.mode))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the benchmark ended without a word
            return
        if request[0] == "close":
            return
        _, prompt, max_new_tokens, eos = request
        try:
            tokens, seconds = peer.generate(prompt, max_new_tokens, frozenset(eos))
        except Exception as exc:  # as above: the row reports it, the benchmark goes on
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            return
        conn.send(("ok", [int(t) for t in tokens], float(seconds)))
