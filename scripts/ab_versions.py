"""Two versions of this code on the same engine, in one run, interleaved per prompt: a refactor's check
that behaviour did not change (identical tokens, the same speed within noise).

Each version runs in its own worker process (Python cannot import two versions of one package), on
the same engine, prompts and threads. For every prompt both workers decode plain and with the
engine's default drafting (``medusa-bench``'s ``plain`` and ``medusa`` rows), one after the other,
alternating which version goes first. Greedy, the runtime's default new tokens (128) unless told.

    git worktree add ../before <rev>                 # the version to compare with
    .venv/bin/python scripts/ab_versions.py --before ../before --engine build/smollm2-135m-medusa \\
        --prompts ../shared/data/spec_bench_dev.jsonl --every 3 --threads 2 --out docs/results/bench-refactor-ab.json

``--before`` is a checkout of the repository root (the package maps to it as ``medusa_trt``); the
other version is the code this script is run from.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("ab_versions")
ROOT = Path(__file__).resolve().parents[1]


def worker(engine: str, threads: int | None, max_new_tokens: int) -> None:
    """Serve prompts read from stdin (one JSON string a line): answer each with one JSON line holding
    both rows' token ids, seconds and tokens per step."""
    from medusa_trt.runtime import MedusaRuntime

    drafted = MedusaRuntime(engine, threads=threads)
    plain = drafted.with_drafters(())
    for rt in (drafted, plain):  # warm-up: first calls pay one-time costs
        rt.generate("Hello", max_new_tokens=4)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        prompt = json.loads(line)
        ids = drafted.codec.encode(prompt, chat=drafted.is_chat)
        if len(ids) + max_new_tokens > drafted.max_context:  # as medusa-bench: only prompts that fit with their new tokens
            print(json.dumps({"skipped": len(ids)}), flush=True)
            continue
        answer = {}
        for name, rt in (("plain", plain), ("medusa", drafted)):
            tick = time.perf_counter()
            r = rt.generate(ids, max_new_tokens=max_new_tokens)
            answer[name] = {"ids": r.token_ids, "seconds": time.perf_counter() - tick, "steps": r.stats.steps}
        print(json.dumps(answer), flush=True)


def _start(root: Path, args) -> subprocess.Popen:
    """A worker importing ``medusa_trt`` from ``root`` (a repository checkout)."""
    shim = Path(tempfile.mkdtemp(prefix="ab-versions-"))
    (shim / "medusa_trt").symlink_to(root.resolve(), target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(shim))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--engine", args.engine, "--max-new-tokens", str(args.max_new_tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    if json.loads(proc.stdout.readline()).get("ready") is not True:
        raise RuntimeError(f"the worker for {root} did not start")
    return proc


def _ask(proc: subprocess.Popen, prompt: str) -> dict:
    proc.stdin.write(json.dumps(prompt) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def _summary(answers: list[dict], row: str) -> dict:
    tokens = sum(len(a[row]["ids"]) for a in answers)
    seconds = sum(a[row]["seconds"] for a in answers)
    steps = sum(a[row]["steps"] for a in answers)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tokens_per_step": tokens / max(steps, 1)}


def compare(args) -> dict:
    from medusa_trt.bench.prompts import read_prompts  # medusa-bench's reader: the same prompts, the same errors

    prompts = read_prompts(args.prompts)[:: args.every][: args.limit]
    versions = {"before": Path(args.before), "after": ROOT}
    procs = {name: _start(root, args) for name, root in versions.items()}
    answers: dict[str, list[dict]] = {name: [] for name in versions}
    try:
        for i, prompt in enumerate(prompts):
            order = list(versions) if i % 2 == 0 else list(versions)[::-1]  # alternate who goes first
            got = {name: _ask(procs[name], prompt) for name in order}
            if any("skipped" in a for a in got.values()):
                continue
            for name in versions:
                answers[name].append(got[name])
            log.info("prompt %d/%d", i + 1, len(prompts))
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    report = {
        "engine": args.engine,
        "prompts": len(answers["after"]),  # those that fit the context with their new tokens
        "every": args.every,
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "before": str(versions["before"]),
    }
    for name in versions:
        plain, medusa = _summary(answers[name], "plain"), _summary(answers[name], "medusa")
        report[name] = {"plain": plain, "medusa": medusa, "speedup": medusa["tokens_per_s"] / plain["tokens_per_s"]}
    for row in ("plain", "medusa"):
        same = [a[row]["ids"] == b[row]["ids"] for a, b in zip(answers["before"], answers["after"])]
        report[f"{row}_identical"] = f"{sum(same)}/{len(same)}"
    equal = sum(a["medusa"]["ids"] == a["plain"]["ids"] for a in answers["after"])
    report["after_medusa_equals_plain"] = f"{equal}/{len(answers['after'])}"
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="a checkout of the version to compare with")
    p.add_argument("--engine", default="build/smollm2-135m-medusa")
    p.add_argument("--prompts", default="../shared/data/spec_bench_dev.jsonl")
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--limit", type=int)
    p.add_argument("--max-new-tokens", type=int, help="default: the runtime's DEFAULT_MAX_NEW_TOKENS")
    p.add_argument("--threads", type=int)
    p.add_argument("--out", help="write the report here (JSON)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.engine, args.threads, args.max_new_tokens)
        return 0
    if not args.before:
        p.error("--before DIR is required: a checkout of the version to compare with")
    if args.max_new_tokens is None:  # read here, not at import: a worker imports the other version's package
        from medusa_trt.runtime.config import DEFAULT_MAX_NEW_TOKENS

        args.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = compare(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
