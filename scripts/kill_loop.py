"""kill -9 medusa-export and medusa-train at random points; every earlier engine and heads folder must survive.

That check by hand, rerunnable: writes an engine folder, a loose ``.onnx`` engine and a heads folder
once, then starts ``--kills`` rewrites of them (round robin, each with another setting so the new
content differs from the old), SIGKILLs each at a random point of its expected run time (some
finish first), and checks the target right after, before any later writer recovers anything:

  * it is there, its manifest verifies (sizes and sha256) and it loads (an engine generates four
    tokens; heads load against the model);
  * it is the old content or the new one (the manifest names which);
  * what the killed writer left beside it (``.NAME.STEP.PID.N@HOST``) is listed; the next writer
    to the same target clears it, which the final clean rewrites check.

  .venv/bin/python scripts/kill_loop.py                 # 20 kills in a temporary folder
  .venv/bin/python scripts/kill_loop.py --kills 5 --seed 1 --work build/kill-loop
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K.gguf"
EXPORT = ["--untrained-heads", "2", "--max-context", "64", "--no-verify"]
TRAIN = ["--heads", "2", "--num-prompts", "8", "--new-tokens", "16", "--epochs", "1", "--batch-size", "64", "--checkpoint-every", "1"]

log = logging.getLogger("kill_loop")


@dataclass(frozen=True)
class Target:
    name: str  # engine folder | loose .onnx | heads folder
    path: Path
    manifest: Path  # the file whose content says which version is there

    def command(self, variant: int) -> list[str]:
        """The rewrite of this target; ``variant`` changes its content (tree / learning rate)."""
        if self.name == "heads folder":
            lr = ("1e-3", "2e-3")[variant % 2]
            return ["-m", "medusa_trt.cli.train", "--model", str(MODEL), "--out", str(self.path), *TRAIN, "--lr", lr, "--restart"]
        tree = ("chain-1", "chain-2")[variant % 2]
        # an engine folder with a given step cost: no timing of the written engine (minutes on a busy CPU)
        cost = ["--step-cost", str(self.path.parent / "step_cost.json")] if self.name == "engine folder" else []
        return ["-m", "medusa_trt.cli.export", "--model", str(MODEL), *EXPORT, *cost, "--tree", tree, "--out", str(self.path)]


def run(target: Target, variant: int, kill_after: float | None) -> tuple[int, float]:
    """Run the rewrite, SIGKILLed after ``kill_after`` seconds (None: to the end). (exit code, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, *target.command(variant)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        proc.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    code = proc.returncode
    if code not in (0, -signal.SIGKILL):
        raise SystemExit(f"{target.name}: {' '.join(target.command(variant))} failed ({code}): {proc.stderr.read()[-2000:]}")
    return code, time.monotonic() - start


def verify(target: Target) -> str:
    """Raise unless the target is whole and loads; returns its manifest's text."""
    from medusa_trt.runtime.engine import EngineFiles

    if target.name == "heads folder":
        from medusa_trt.exporter import load_base_model
        from medusa_trt.exporter.heads import load_heads
        from medusa_trt.runtime.manifest import check_folder_manifest

        assert check_folder_manifest(target.path), f"{target.path} has no files.json"
        base = load_base_model(MODEL)
        cfg = base.model.config
        load_heads(target.path, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, lm_head=base.model.lm_head)
    else:
        from medusa_trt.runtime import MedusaRuntime
        from medusa_trt.runtime.manifest import check_manifest

        assert check_manifest(EngineFiles.locate(target.path), checksums=True), f"{target.path} has no manifest"
        MedusaRuntime(target.path).generate(["Once upon a time"], max_new_tokens=4)
    return target.manifest.read_text()


def leftovers(target: Target) -> list[str]:
    return sorted(p.name for p in target.path.parent.iterdir() if p.name.startswith(f".{target.path.name}."))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", help="folder for the targets (default: a temporary one, removed after)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rng = random.Random(args.seed)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kill-loop-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "step_cost.json").write_text('{"1": 1.0, "64": 1.5}')
    targets = [
        Target("engine folder", work / "eng", work / "eng" / "files.json"),
        Target("loose .onnx", work / "m.onnx", work / "m.onnx.files.json"),
        Target("heads folder", work / "heads", work / "heads" / "files.json"),
    ]
    seconds, state, variant = {}, {}, {}
    for t in targets:  # the earlier versions every kill must leave intact
        code, seconds[t.name] = run(t, 0, None)
        state[t.name], variant[t.name] = verify(t), 0
        print(f"wrote {t.name} {t.path.name}: {seconds[t.name]:.1f} s", flush=True)
    versions = {t.name: {state[t.name]: 0} for t in targets}
    print(f"{'#':>3}  {'target':<14} {'kill at':>8}  {'writer':<9} {'after the kill':<15} {'leftovers beside it'}")
    tally = {"old kept": 0, "new in place": 0}
    for i in range(args.kills):
        t = targets[i % len(targets)]
        v = variant[t.name] + 1
        kill_after = rng.uniform(0.05, 1.05) * seconds[t.name]  # some land in the final swap, some after the end
        code, took = run(t, v, kill_after)
        if code == 0:
            seconds[t.name] = took  # a rewrite resumes what it can (medusa-train's sequences): aim at its real length
        found = verify(t)  # before anything recovers: whole and loadable
        if found == state[t.name]:
            outcome = "old kept"
        else:
            outcome = "new in place"
            state[t.name], variant[t.name] = found, v
            versions[t.name].setdefault(found, v)
        tally[outcome] += 1
        writer = "finished" if code == 0 else "killed"
        print(f"{i + 1:>3}  {t.name:<14} {kill_after:>7.1f}s  {writer:<9} {outcome:<15} {', '.join(leftovers(t)) or '-'}", flush=True)
    for t in targets:  # the next writer to each target clears what the killed ones left
        run(t, variant[t.name] + 1, None)
        verify(t)
        assert not leftovers(t), f"{t.name}: leftovers after a clean rewrite: {leftovers(t)}"
    stray = [p.name for p in work.iterdir() if p.name.startswith(".")]
    print(f"{args.kills} kills: {tally['old kept']} left the old version, {tally['new in place']} the new; every target whole and loadable")
    print(f"after one clean rewrite of each: leftovers {stray or 'none'}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not stray else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    sys.exit(main())
