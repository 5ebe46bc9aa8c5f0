"""The native step's threads (runtime/native_pool.c): the same numbers on any thread count, one step at a time on a
step object whatever Python threads call it, a forked child that steps without its parent's threads, threads that stop
with their step object, and a default count within the CPUs and quota this process has."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import medusa_model

from medusa_trt.runtime import native_step, native_weights
from medusa_trt.runtime.engine import EngineError

ROWS, TOKENS = 1, 12


@pytest.fixture(scope="module")
def weights(stories_base, stories_fitted, export_engine):
    engine = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))  # shared with test_runtime
    return native_weights.read_weights(engine, "llama")  # the .onnx step graph


def _arrays(weights, tokens: int = TOKENS, seed: int = 0) -> dict:
    """A prefill of ``tokens`` tokens over an empty cache, with outputs of its own."""
    d = weights.dims
    kv = (d.layers, ROWS, d.kv_heads, d.head_dim)
    ids = np.random.default_rng(seed).integers(0, d.vocab, (ROWS, tokens), dtype=np.int64)
    return dict(
        input_ids=ids,
        position_ids=np.arange(tokens, dtype=np.int64)[None].repeat(ROWS, 0),
        tree_mask=np.tril(np.ones((ROWS, tokens, tokens), dtype=bool)),
        cache_lengths=np.zeros(ROWS, dtype=np.int64),
        past_key=np.zeros((0, *kv), dtype=np.float32),
        past_value=np.zeros((0, *kv), dtype=np.float32),
        new_key=np.zeros((tokens, *kv), dtype=np.float32),
        new_value=np.zeros((tokens, *kv), dtype=np.float32),
        hidden=np.zeros((ROWS, tokens, d.hidden), dtype=np.float32),
        logits=np.zeros((ROWS, tokens, d.vocab), dtype=np.float32),
        next_ids=np.zeros((ROWS, tokens), dtype=np.int64),
        next_topk=np.zeros((ROWS, tokens, 4), dtype=np.int64),
    )


def _run(kernel, a: dict) -> dict:
    kernel.step(*a.values())
    return a


def _kernel(weights, threads: int):
    return native_step.NativeStep(weights, rows=ROWS * TOKENS, slots=64, threads=threads)


@pytest.fixture(scope="module")
def reference(weights) -> dict:
    return _run(_kernel(weights, 1), _arrays(weights))


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_any_thread_count_gives_the_same_numbers(weights, reference, threads):
    """More threads than this machine's cores too: chunks go to whichever thread is free, each computed the same way."""
    out = _run(_kernel(weights, threads), _arrays(weights))
    for name in ("logits", "hidden", "new_key", "new_value", "next_ids", "next_topk"):
        assert np.array_equal(out[name], reference[name]), name


def test_two_python_threads_never_share_a_steps_scratch(weights, reference):
    """Two threads step one object with outputs of their own: each call is refused in one line while the other runs,
    or gives the reference numbers; never numbers computed over the other's scratch."""
    kernel = _kernel(weights, 2)
    refused, wrong, errors = [], [], []

    def hammer():
        for _ in range(40):
            try:
                out = _run(kernel, _arrays(weights))
            except EngineError as exc:
                (refused if "one at a time" in str(exc) else errors).append(str(exc))
                continue
            if not np.array_equal(out["logits"], reference["logits"]):
                wrong.append(1)

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and not errors, (len(wrong), errors[:1])
    assert refused  # the calls did overlap (27 of 80 refused in one run here)
    assert np.array_equal(_run(kernel, _arrays(weights))["logits"], reference["logits"])  # still whole afterwards


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_steps_without_its_parents_threads(weights, reference):
    """The child of a fork has none of the pool's threads; its calling thread takes every chunk (OpenMP's libgomp hangs
    or aborts there)."""
    kernel = _kernel(weights, 2)
    _run(kernel, _arrays(weights))  # the pool's threads are up
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only with the reference numbers
        try:
            ok = np.array_equal(_run(kernel, _arrays(weights))["logits"], reference["logits"])
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="no /proc here")
def test_threads_stop_with_their_step_object(weights):
    gc.collect()
    before = _threads_now()
    kernels = [_kernel(weights, 4) for _ in range(3)]
    assert _threads_now() == before + 3 * 3  # three workers each beside the caller
    del kernels
    gc.collect()
    assert _threads_now() == before


@pytest.mark.parametrize(
    "text, cpus", [("150000 100000\n", 2), ("100000 100000", 1), ("50000 100000", 1), ("max 100000", None), ("", None), ("x y", None)]
)
def test_a_cgroup_quota_caps_the_default_threads(tmp_path, text, cpus):
    (tmp_path / "cpu.max").write_text(text)
    assert native_step.cpu_quota(tmp_path / "cpu.max") == cpus
    assert native_step.cpu_quota(tmp_path / "missing") is None


def test_the_default_thread_count_is_within_this_process_cpus():
    lib = native_step.load_library()
    n = native_step.default_threads(lib)
    assert 1 <= n <= len(os.sched_getaffinity(0))
    assert n == min(len(os.sched_getaffinity(0)), native_step.cpu_quota() or n)


def test_the_pool_alone_under_threadsanitizer(tmp_path):
    """tests/native/pool_check.c: 24,000 jobs of every size on pools of 1 to 8 threads, built with ThreadSanitizer (a
    data race or a task run twice or never fails it)."""
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc here to build the ThreadSanitizer check")
    here, runtime = Path(__file__).parent, Path(native_step.__file__).parent
    binary = tmp_path / "pool_check"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # make test-sanitize preloads ASan: not here
    build = subprocess.run(
        [cc, "-O1", "-g", "-fsanitize=thread", "-pthread", f"-I{runtime}", str(here / "native" / "pool_check.c"),
         str(runtime / "native_pool.c"), "-o", str(binary)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if build.returncode and "tsan" in build.stderr.lower():
        pytest.skip(f"this gcc cannot build with ThreadSanitizer: {build.stderr.strip()[:200]}")
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300, env=env | {"TSAN_OPTIONS": "halt_on_error=1"})
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-2000:]


def test_a_step_that_consumes_its_weights_gives_the_same_numbers(stories_base, stories_fitted, export_engine, reference):
    """``consume``: each layer's linears leave the ``Weights`` as they are packed (what open_native passes: a 7B engine's
    load holds its weights once); the step is the same."""
    engine = export_engine("stories-fitted", medusa_model(stories_base, stories_fitted))
    weights = native_weights.read_weights(engine, "llama")  # its own copy: the module's stays whole
    kernel = native_step.NativeStep(weights, rows=ROWS * TOKENS, slots=64, threads=1, consume=True)
    assert all(m is None for k in ("qkv", "o", "gate_up", "down") for m in getattr(weights, k))
    out = _run(kernel, _arrays(weights))  # its dims stay
    for name in ("logits", "hidden", "new_key", "new_value", "next_ids"):
        assert np.array_equal(out[name], reference[name]), name
