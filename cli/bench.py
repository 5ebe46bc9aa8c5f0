"""``medusa-bench``: Medusa against its peers, side by side in one process, interleaved per prompt.

    medusa-bench --engine build/model.onnx --prompts ../shared/data/spec_bench_dev.jsonl --max-new-tokens 128

Methods, on the same prompt token ids (greedy by default; with --temperature every method samples
with the same temperature / top-p / top-k, prompt i seeded with seed + i):
  * ``plain``      : autoregressive decoding on the same engine (no drafters)
  * ``medusa``     : the engine's drafters (``--draft`` repeatable: one row per drafter set) with
                     the engine's heads template (or ``--tree``, repeatable)
  * ``hf``         : ``transformers`` ``generate()`` on the same base model (needs torch; ``--no-hf`` skips)
  * ``hf-lookup``  : the same with ``prompt_lookup_num_tokens`` (self-speculative peer built into transformers)
  * ``llama.cpp[F]``: ``--peer llama.cpp:F.gguf`` (repeatable): llama.cpp on a GGUF of the same model, greedy,
                     the same threads (``llama.cpp+lookup`` with its prompt-lookup decoding); ``medusa_trt.bench.peers``
Repeat ``--engine`` to compare engines (int4 and int8 ones against fp32, say): each gets ``plain`` and
``medusa`` rows; greedy agreement is measured against the first engine's plain decoding (share of
prompts identical, mean matching prefix) and against the row's own engine's plain decoding (prompts
identical: drafting is lossless when all are), speed against both plain rows.
Repeat ``--acceptance`` to compare rules (lossless, typical) on the same engine and tree.
Prints a table; with ``--out FILE.json`` also writes the JSON report and a PNG plot beside it
(``FILE.png``, with matplotlib). Agreement between methods is only meaningful for greedy decoding.
Bad input prints one ``medusa-bench: error: ...`` line and exits 2, before any engine loads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from medusa_trt.cli.common import USER_ERRORS, Parser, drafter_list, entry, fail, non_negative_int, positive_int, setup_logging
from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger("medusa_trt.cli.bench")


LOOKUP_TOKENS = 10  # prompt_lookup_num_tokens of the hf-lookup row unless --lookup-tokens says otherwise
SEED = 0  # prompt i samples with SEED + i unless --seed says otherwise


def build_parser() -> Parser:
    from medusa_trt.runtime.sampling import SamplingParams

    p = Parser(prog="medusa-bench", description="Benchmark Medusa against plain decoding and transformers.")
    p.add_argument("--engine", action="append", required=True, help="an exported engine (folder, .onnx or .plan); repeat to compare engines")
    p.add_argument("--prompts", required=True, help="Spec-Bench style JSONL (UTF-8): turns[0] is the prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--limit", type=positive_int, help="use the first N prompts (after --every)")
    p.add_argument("--every", type=positive_int, default=1, help="use every N-th prompt (a subset spread over all categories)")
    p.add_argument("--tree", action="append", help="heads template for the medusa rows (default: each engine's own); repeat to compare")
    p.add_argument("--draft", action="append", type=drafter_list, metavar="LIST",
                   help="drafter set of a medusa row, comma-separated (heads,lookup,recycle); repeat for one row each "
                        "(default: every drafter the engine supports)")
    p.add_argument("--model", help="base model for the transformers rows (default: the one the engine records)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers rows (no torch needed)")
    p.add_argument("--peer", action="append", metavar="KIND:GGUF",
                   help="another engine on the same prompt ids, greedy, same threads, interleaved: llama.cpp:FILE.gguf "
                        "(llama-cpp-python; make peers builds it) or llama.cpp+lookup:FILE.gguf (with its prompt-lookup "
                        "decoding); the file must be a GGUF of the engine's model; repeatable")
    p.add_argument("--lookup-tokens", type=positive_int, help=f"prompt_lookup_num_tokens of the hf-lookup row (default {LOOKUP_TOKENS})")
    p.add_argument("--threads", type=positive_int, help="intra-op threads for ONNX Runtime and torch")
    p.add_argument("--out", help="write the JSON report here (FILE.json) and the plot beside it (FILE.png); "
                                 "default: print the table only, write nothing")
    g = p.add_argument_group("sampling (default: greedy; these need --temperature above 0)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, help=f"default {SamplingParams.top_p}")
    g.add_argument("--top-k", type=non_negative_int, help=f"default {SamplingParams.top_k} (all tokens)")
    g.add_argument("--seed", type=non_negative_int, help=f"prompt i is sampled with seed + i, the same for every method (default {SEED})")
    g.add_argument("--acceptance", action="append", choices=["typical", "lossless"],
                   help="acceptance rule of the medusa rows (default lossless); repeat to compare")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def check_options(args) -> None:
    """Refuse options that would be silently ignored or would make rows collide; fill in the sampling defaults."""
    from medusa_trt.runtime.sampling import SamplingParams

    if args.no_hf:
        for flag, value in (("--model", args.model), ("--lookup-tokens", args.lookup_tokens)):
            if value is not None:
                raise MedusaError(f"{flag} applies to the transformers rows, which --no-hf skips: drop one of the two")
    if args.temperature <= 0:
        given = [flag for flag, value in (("--top-p", args.top_p), ("--top-k", args.top_k), ("--seed", args.seed),
                                          ("--acceptance", args.acceptance)) if value is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise MedusaError(f"{' / '.join(given)} {verb} when sampling: add --temperature (e.g. 0.7), or drop it for greedy decoding")
    from medusa_trt.bench.peers import binding_missing, parse_peer

    args.peers = [parse_peer(text) for text in args.peer or []]
    if args.peers and args.temperature > 0:
        raise MedusaError("--peer rows decode greedily: drop --temperature, or drop --peer")
    if args.peers and binding_missing():
        raise MedusaError(f"--peer {args.peer[0]}: {binding_missing()}")
    names = [Path(e).stem for e in args.engine]
    drafts = [",".join(d) or "none" for d in args.draft or []]
    peers = [p.name for p in args.peers]
    for what, values in (("--engine", names), ("--tree", args.tree or []), ("--acceptance", args.acceptance or []), ("--draft", drafts),
                         ("--peer", peers)):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise MedusaError(f"{what} {repeated[0]} is given twice: its rows would overwrite each other "
                              f"({'engines are named by file stem: rename one' if what == '--engine' else 'drop the repeat'})")
    args.top_p = SamplingParams.top_p if args.top_p is None else args.top_p
    args.top_k = SamplingParams.top_k if args.top_k is None else args.top_k
    args.seed = SEED if args.seed is None else args.seed
    args.lookup_tokens = args.lookup_tokens or LOOKUP_TOKENS


def read_prompts(path: str, limit: int | None = None) -> list[str]:
    """turns[0] of every record of a Spec-Bench style JSONL file (UTF-8, one JSON object a line, blank lines skipped)."""
    file = Path(path)
    if file.is_dir():
        raise MedusaError(f"prompts file {file} is a folder: pass a .jsonl file")
    if not file.is_file():
        raise MedusaError(f"prompts file {file} does not exist")
    prompts = [_prompt(file, n, raw) for n, raw in enumerate(file.read_bytes().splitlines(), 1) if raw.strip()]
    if not prompts:
        raise MedusaError(f"{file} holds no prompts: write one JSON record a line, such as {{\"turns\": [\"Hello\"]}}")
    return prompts[:limit] if limit else prompts


def _prompt(file: Path, n: int, raw: bytes) -> str:
    """The prompt on line n, or an error naming the file, the line and the fix."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MedusaError(f"{file}:{n}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}): "
                          "save the file as UTF-8") from exc
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise MedusaError(f"{file}:{n}: not a JSON record ({exc.msg} at column {exc.colno}): "
                          "write one JSON object a line, such as {\"turns\": [\"Hello\"]}") from exc
    turns = record.get("turns") if isinstance(record, dict) else None
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise MedusaError(f"{file}:{n}: not a Spec-Bench record with turns[0] (a non-empty string): "
                          "write it as {\"turns\": [\"Hello\"]}")
    return turns[0]


# ----------------------------------------------------------------- the output files


def check_out(raw: str, suffix: str, companions: tuple[str, ...] = ()) -> Path:
    """--out as a file that can be written, checked before any work: its folder exists and takes new
    files, and neither it nor a companion written beside it (``.png``, ...) is a folder."""
    out = Path(raw)
    if raw.endswith(("/", os.sep)) or out.is_dir():
        raise MedusaError(f"--out {raw} is a folder: name the file to write, such as {out / ('report' + suffix)}")
    if out.suffix != suffix:
        raise MedusaError(f"--out {out} must end in {suffix}")
    folder = out.parent
    if not folder.is_dir():
        what = f"{folder} is not a folder" if folder.exists() else f"folder {folder} does not exist"
        raise MedusaError(f"cannot write {out}: {what}; create it or pick another --out")
    for path in (out.with_suffix(c) for c in companions):
        if path.is_dir():
            raise MedusaError(f"cannot write {path} beside --out {out}: it is a folder; pick another --out")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{out.name}.", suffix=".probe"):
            pass  # the folder takes new files: the temp files of staged() will go there
    except OSError as exc:
        raise MedusaError(f"cannot write {out}: folder {folder} is not writable ({exc.strerror}); pick another --out") from exc
    return out


@contextlib.contextmanager
def staged(*targets: Path):
    """Yield a temp path beside each target (same suffix); when the block succeeds each temp that was
    written is renamed onto its target, whatever happens no temp is left: a reader never sees half a
    file and a failure leaves nothing behind."""
    temps = [t.with_name(f".{t.stem}.{os.getpid()}.tmp{t.suffix}") for t in targets]
    try:
        yield temps
        for tmp, target in zip(temps, targets):
            if tmp.exists():
                tmp.replace(target)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)


class _Row:
    def __init__(self, name: str):
        self.name, self.tokens, self.seconds, self.steps = name, 0, 0.0, []
        self.verify_seconds = self.heads_seconds = self.host_seconds = 0.0
        self.drafted = 0  # draft tokens verified (tree nodes past the root), summed over steps
        self.outputs: list[list[int]] = []

    def add(self, token_ids: list[int], seconds: float, accepted: list[int] | None = None, verify: float = 0.0, heads: float = 0.0,
            host: float = 0.0, drafted: int = 0):
        self.host_seconds += host
        self.drafted += drafted
        self.tokens += len(token_ids)
        self.seconds += seconds
        self.steps += accepted or []
        self.verify_seconds += verify
        self.heads_seconds += heads
        self.outputs.append(list(token_ids))

    def report(self, reference: _Row, own: _Row | None = None) -> dict:
        """Rates and agreement: with ``reference`` (the first engine's plain decoding) and with
        ``own``, the plain decoding of this row's engine (None for the transformers rows)."""
        same = [a == b for a, b in zip(self.outputs, reference.outputs)]
        prefix = [_common_prefix(a, b) / max(len(b), 1) for a, b in zip(self.outputs, reference.outputs)]
        own_same = [a == b for a, b in zip(self.outputs, own.outputs)] if own is not None else []
        return {
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "new_tokens": self.tokens,
            "seconds": self.seconds,
            "mean_accepted_per_step": float(np.mean(self.steps)) if self.steps else None,
            "mean_nodes_per_step": 1 + self.drafted / len(self.steps) if self.steps else None,  # the verify tree, root included
            "heads_share_of_step_time": self.heads_seconds / (self.verify_seconds + self.heads_seconds) if self.verify_seconds else None,
            "host_ms_per_step": 1000 * self.host_seconds / len(self.steps) if self.steps else None,
            "identical_to_reference": float(np.mean(same)),
            "matching_prefix_fraction": float(np.mean(prefix)),
            "identical_to_own_plain": float(np.mean(own_same)) if own_same else None,
            "identical_to_own_plain_prompts": f"{sum(own_same)}/{len(own_same)}" if own_same else None,
        }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _hf_model(name: str, threads: int | None):
    try:
        import torch

        from medusa_trt.exporter.models import load_base_model
    except ImportError as exc:  # the lean install: ONNX Runtime only
        raise MedusaError(f"the transformers rows need torch and transformers ({exc.name} is not installed): "
                          "pip install 'medusa-trt[export]', or pass --no-hf") from exc

    if threads:
        torch.set_num_threads(threads)
    return load_base_model(name)


def _hf_generate(base, ids: list[int], max_new_tokens: int, eos: list[int], lookup: int | None, sampling=None) -> tuple[list[int], float]:
    import torch

    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if sampling is not None and sampling.temperature > 0:
        torch.manual_seed(sampling.seed)
        extra |= dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
    else:
        extra |= dict(do_sample=False, top_k=None, top_p=None, temperature=None)
    start = time.perf_counter()
    with torch.inference_mode():
        out = base.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, eos_token_id=eos,
                                  pad_token_id=eos[0] if eos else 0, **extra)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def run_bench(args) -> dict:
    from tqdm.auto import tqdm

    from medusa_trt.runtime import MedusaRuntime
    from medusa_trt.runtime.sampling import SamplingParams

    sampled = args.temperature > 0
    rules = (args.acceptance or ["lossless"]) if sampled else [None]

    def params(rule, i):  # prompt i: the same seed for every method
        return SamplingParams(args.temperature, args.top_p, args.top_k, seed=args.seed + i, acceptance=rule)

    params(rules[0], 0)  # bad sampling options fail before any engine loads
    prompts = read_prompts(args.prompts)[:: args.every][: args.limit]
    engines = []  # (name, plain runtime, {row name: (medusa runtime, rule)}) sharing one session per engine
    for path in args.engine:
        own = MedusaRuntime(path, max_batch=1, threads=args.threads)
        name = Path(path).stem
        trees, drafts = args.tree or [None], args.draft or [None]
        variants = {}
        for tree in trees:
            with_tree = own.with_tree(tree) if tree else own
            for draft in drafts:
                rt = with_tree.with_drafters(draft) if draft is not None else with_tree
                for rule in rules:
                    label = name if len(trees) == 1 else f"{name}:{rt.tree.name}"
                    label += f":{','.join(rt.drafting.names) or 'none'}" if len(drafts) > 1 else ""
                    label += f":{rule}" if len(rules) > 1 else ""
                    variants[f"medusa[{label}]"] = (rt, rule)
        engines.append((name, (own.plain(), rules[0]), variants))
    first = next(iter(engines[0][2].values()))[0]
    meta = first.backend.meta
    ids = [first.codec.encode(p, chat=first.is_chat) for p in prompts]
    room = min(rt.max_context for _, _, v in engines for rt, _ in v.values()) - args.max_new_tokens
    fits = [i for i, x in enumerate(ids) if len(x) <= room]
    if len(fits) < len(ids):
        log.warning("skipping %d of %d prompts longer than %d tokens (the engine's context less --max-new-tokens)",
                    len(ids) - len(fits), len(ids), room)
        prompts, ids = [prompts[i] for i in fits], [ids[i] for i in fits]
    if not ids:
        raise MedusaError(f"no prompt fits the engine's context with --max-new-tokens {args.max_new_tokens}: "
                          "export with a larger --max-context or lower --max-new-tokens")
    eos = sorted(first.eos)
    hf = None if args.no_hf else _hf_model(args.model or meta.model, args.threads)
    rows: dict[str, _Row] = {}
    plain_of: dict[str, str] = {}  # row -> the plain row of its engine
    for name, plain, variants in engines:
        for key, (runtime, rule) in ((f"plain[{name}]", plain), *variants.items()):
            rows[key], plain_of[key] = _Row(key), f"plain[{name}]"
            runtime.generate(ids[0], max_new_tokens=4, sampling=params(rule, 0))  # warm-up: first calls pay one-time costs
    if hf is not None:
        rows["hf"], rows["hf-lookup"] = _Row("hf"), _Row("hf-lookup")
    from medusa_trt.bench.peers import make_peer

    peers = [make_peer(spec, threads=args.threads, context=first.max_context, vocab_size=meta.vocab_size) for spec in args.peers]
    for peer in peers:
        rows[peer.name] = _Row(peer.name)
        peer.generate(ids[0], 4, frozenset(eos))  # warm-up, as for the engines
    for i, prompt in enumerate(tqdm(ids, desc="medusa-bench", unit="prompt", disable=None)):
        for name, plain, variants in engines:  # interleaved: drift in machine speed hits every method alike
            for key, (runtime, rule) in ((f"plain[{name}]", plain), *variants.items()):
                r = runtime.generate(prompt, max_new_tokens=args.max_new_tokens, sampling=params(rule, i))
                rows[key].add(r.token_ids, r.stats.seconds, r.stats.accepted_per_step, r.stats.verify_seconds, r.stats.heads_seconds,
                              r.stats.host_seconds, r.stats.drafted_tokens)
        for peer in peers:
            rows[peer.name].add(*peer.generate(prompt, args.max_new_tokens, frozenset(eos)))
        if hf is not None:
            rows["hf"].add(*_hf_generate(hf, prompt, args.max_new_tokens, eos, None, params(None, i)))
            rows["hf-lookup"].add(*_hf_generate(hf, prompt, args.max_new_tokens, eos, args.lookup_tokens, params(None, i)))
    reference = rows[f"plain[{engines[0][0]}]"]
    report = {
        "engines": args.engine, "model": meta.model, "tree": first.tree.name, "tree_nodes": first.tree.num_nodes,
        "trees": {key: {"name": rt.tree.name, "nodes": rt.tree.num_nodes, "drafters": list(rt.drafting.names)}
                  for _, _, v in engines for key, (rt, _) in v.items()},
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
                     "acceptance": rules} if sampled else "greedy",
        "prompts": len(prompts), "prompts_file": str(args.prompts), "every": args.every, "max_new_tokens": args.max_new_tokens,
        "reference": reference.name, "methods": {k: r.report(reference, rows.get(plain_of.get(k))) for k, r in rows.items()},
    }
    base_rate = report["methods"][reference.name]["tokens_per_s"]
    for name, m in report["methods"].items():
        m["speedup_vs_plain"] = m["tokens_per_s"] / base_rate if base_rate else None
        own_rate = report["methods"][plain_of[name]]["tokens_per_s"] if name in plain_of else None
        m["speedup_vs_own_plain"] = m["tokens_per_s"] / own_rate if own_rate else None
        if hf is not None:
            m["speedup_vs_hf"] = m["tokens_per_s"] / report["methods"]["hf"]["tokens_per_s"]
    report["heads_cost"] = _heads_cost(first)
    return report


def _heads_cost(runtime) -> dict | None:
    """Time the heads graph on one node per sequence (what the loop does) against all tree nodes
    (what a graph that evaluates heads everywhere would pay), beside one verify step."""
    backend = runtime.backend
    if not getattr(backend, "heads_session", None):
        return None
    meta, t = backend.meta, runtime.tree.num_nodes
    session = backend.heads_session
    dtype = backend.dtype

    from medusa_trt.training.calibrate import median_ms

    def timed(fn):
        return median_ms(fn, 10)

    from medusa_trt.runtime.contract import NEXT_INPUT

    def feed(rows: int) -> dict:  # heads on every node, outside the loop: next-token-aware heads also read each row's root
        inputs = {"hidden": np.zeros((rows, meta.hidden_size), dtype=dtype)}
        return inputs | ({NEXT_INPUT: np.zeros(rows, dtype=np.int64)} if meta.reads_roots else {})

    tree = runtime.tree
    step = timed(lambda: backend.step(np.zeros((1, t), dtype=np.int64), tree.depth[None] + 128, tree.mask[None], np.array([128])))
    root = np.zeros(1, dtype=np.int64)  # what the loop does after that step: the heads at one node, given the next token
    one = timed(lambda: backend.propose(root, max(tree.top_k, 1), root))
    every = timed(lambda: session.run(None, feed(t)))
    three = np.tril(np.ones((1, 3, 3), dtype=bool))
    step3 = timed(lambda: backend.step(np.zeros((1, 3), dtype=np.int64), np.arange(3)[None] + 128, three, np.array([128])))
    return {"tree_nodes": t, "verify_step_ms_ctx128": step, "verify_3_nodes_ms_ctx128": step3, "heads_one_node_ms": one,
            "heads_all_nodes_ms": every}


def plot(report: dict, path: Path) -> bool:
    """Bar chart of tokens/s; False (and a warning) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib not installed: no plot (pip install matplotlib)")
        return False
    names = list(report["methods"])
    rates = [report["methods"][n]["tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(max(8.0, 1.0 * len(names)), 4))  # wider for many engines' rows
    bars = ax.bar(names, rates, color=["#4c72b0" if n.startswith("medusa") else "#999999" for n in names])
    ax.set_ylim(0, 1.15 * max(rates, default=1.0) or 1.0)  # room for the labels above the bars
    for bar, name in zip(bars, names):
        acc = report["methods"][name]["mean_accepted_per_step"]
        label = f"{bar.get_height():.1f}" + (f"\n{acc:.2f}/step" if acc and name.startswith("medusa") else "")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{report['model']}: {report['prompts']} prompts, {report['max_new_tokens']} new tokens, tree {report['tree']}")
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


@entry("medusa-bench")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        out = check_out(args.out, ".json", (".png",)) if args.out else None  # before any benchmark work
        check_options(args)
        report = run_bench(args)
        written = write_report(report, out) if out else []
    except USER_ERRORS as exc:
        return fail("medusa-bench", exc)
    print_table(report, written)
    sys.stdout.flush()  # a closed pipe (| head) surfaces here, where entry() turns it into a quiet exit
    return 0


def write_report(report: dict, out: Path) -> list[Path]:
    """The JSON report at ``out`` and the plot beside it, each written whole or not at all; returns what was written."""
    png = out.with_suffix(".png")
    try:
        with staged(out, png) as (tmp_json, tmp_png):
            tmp_json.write_text(json.dumps(report, indent=2))
            plotted = plot(report, tmp_png)
    except OSError as exc:  # a full disk, a folder that went away: nothing was left behind
        raise MedusaError(f"cannot write {out}: {exc.strerror or exc}: check the folder (free space, permissions) or pick another --out") from exc
    return [out, png] if plotted else [out]


def print_table(report: dict, written: list[Path]) -> None:
    print(f"{report['prompts']} prompts x {report['max_new_tokens']} new tokens, tree {report['tree']} ({report['tree_nodes']} nodes), "
          f"agreement vs {report['reference']}")
    # vs plain / identical / prefix: against the reference; vs own / = own plain: against the plain row of the row's engine
    print(f"{'method':<48}{'tok/s':>8}{'acc/step':>10}{'vs plain':>10}{'vs own':>8}{'vs hf':>8}{'identical':>11}{'prefix':>8}"
          f"{'= own plain':>13}{'host ms/step':>14}")
    greedy = report["sampling"] == "greedy"  # samples differ by design: agreement columns only for greedy decoding
    for name, m in report["methods"].items():
        acc = f"{m['mean_accepted_per_step']:.2f}" if m["mean_accepted_per_step"] else "-"
        vs_hf = f"{m['speedup_vs_hf']:.2f}x" if m.get("speedup_vs_hf") else "-"
        vs_own = f"{m['speedup_vs_own_plain']:.2f}x" if m.get("speedup_vs_own_plain") else "-"
        same = f"{m['identical_to_reference']:.0%}" if greedy else "-"
        prefix = f"{m['matching_prefix_fraction']:.0%}" if greedy else "-"
        own = m.get("identical_to_own_plain_prompts") if greedy and m.get("identical_to_own_plain_prompts") else "-"
        host = f"{m['host_ms_per_step']:.2f}" if m.get("host_ms_per_step") is not None else "-"
        print(f"{name:<48}{m['tokens_per_s']:>8.1f}{acc:>10}{m['speedup_vs_plain']:>9.2f}x{vs_own:>8}{vs_hf:>8}{same:>11}{prefix:>8}"
              f"{own:>13}{host:>14}")
    cost = report["heads_cost"]
    if cost:
        print(f"heads cost: {cost['heads_one_node_ms']:.1f} ms at the accepted node vs {cost['heads_all_nodes_ms']:.1f} ms on all "
              f"{cost['tree_nodes']} nodes; one verify step {cost['verify_step_ms_ctx128']:.1f} ms "
              f"({cost['verify_3_nodes_ms_ctx128']:.1f} ms with 3 nodes)")
    if written:
        print("wrote " + " and ".join(str(p) for p in written))


if __name__ == "__main__":
    sys.exit(main())
