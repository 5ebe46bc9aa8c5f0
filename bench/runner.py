"""What ``medusa-bench`` runs: Medusa against its peers, side by side in one process, interleaved per prompt.

    from medusa_trt.bench import BenchConfig, run
    report = run(BenchConfig(engines=("build/model.onnx",), prompts="../shared/data/spec_bench_dev.jsonl", hf=False))

Rows, on the same prompt token ids (greedy by default; when sampling every method samples with the
same temperature / top-p / top-k, prompt i seeded with seed + i): ``plain[E]`` (engine E without
drafters), ``medusa[E...]`` (its drafters, one row per tree x drafter set x acceptance rule),
``hf`` / ``hf-lookup`` (transformers ``generate()``, bench/hf.py) and the ``--peer`` engines
(bench/peers.py). Agreement is measured against the first engine's plain row and each row's own
engine's plain row, speed against both (bench/report.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.bench.heads_cost import heads_cost
from medusa_trt.bench.hf import hf_generate, hf_model
from medusa_trt.bench.prompts import read_prompts
from medusa_trt.bench.report import Row, methods
from medusa_trt.runtime.config import DEFAULT_MAX_NEW_TOKENS
from medusa_trt.runtime.errors import MedusaError
from medusa_trt.runtime.sampling import SamplingParams

log = logging.getLogger(__name__)

LOOKUP_TOKENS = 10  # prompt_lookup_num_tokens of the hf-lookup row unless the config says otherwise
SEED = 0  # prompt i samples with SEED + i unless the config says otherwise


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark. None / empty fields take the defaults named beside them, filled in on construction;
    options that would be silently ignored or make rows collide raise ``MedusaError`` there, before any engine loads."""

    engines: tuple[str, ...]  # exported engines (folder, .onnx or .plan): each gets a plain row and medusa rows
    prompts: str  # Spec-Bench style JSONL (UTF-8): turns[0] is the prompt
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    limit: int | None = None  # the first N prompts (after every)
    every: int = 1  # every N-th prompt (a subset spread over all categories)
    trees: tuple[str, ...] = ()  # heads templates of the medusa rows, one row each (empty: each engine's own)
    drafts: tuple[tuple[str, ...], ...] = ()  # drafter sets of the medusa rows, one row each (empty: all the engine supports)
    model: str | None = None  # base model of the transformers rows (None: the one the engine records)
    hf: bool = True  # the transformers rows (they need torch)
    peers: tuple[str, ...] = ()  # KIND:GGUF peer engines (bench/peers.py), greedy
    lookup_tokens: int | None = None  # prompt_lookup_num_tokens of the hf-lookup row (None: LOOKUP_TOKENS)
    threads: int | None = None  # intra-op threads for ONNX Runtime and torch
    temperature: float = 0.0  # 0: greedy decoding
    top_p: float | None = None  # None: SamplingParams.top_p
    top_k: int | None = None  # None: SamplingParams.top_k (all tokens)
    seed: int | None = None  # prompt i samples with seed + i (None: SEED)
    acceptance: tuple[str, ...] = ()  # rules of the medusa rows when sampling, one row each (empty: lossless)
    backends: tuple[str, ...] = ()  # NAME[:PRECISION] each engine runs on, one set of rows each (empty: the engine's own)

    def __post_init__(self):
        self._check_ignored()
        self._check_peers()
        self._check_repeats()
        fill = object.__setattr__  # frozen: the defaults are filled in once, here
        fill(self, "top_p", SamplingParams.top_p if self.top_p is None else self.top_p)
        fill(self, "top_k", SamplingParams.top_k if self.top_k is None else self.top_k)
        fill(self, "seed", SEED if self.seed is None else self.seed)
        fill(self, "lookup_tokens", self.lookup_tokens or LOOKUP_TOKENS)
        self.sampling(self.rules[0], 0)  # bad sampling options fail before any engine loads

    def _check_ignored(self) -> None:
        """Refuse options that would be silently ignored."""
        if not self.hf:
            for flag, value in (("--model", self.model), ("--lookup-tokens", self.lookup_tokens)):
                if value is not None:
                    raise MedusaError(f"{flag} applies to the transformers rows, which --no-hf skips: drop one of the two")
        if self.temperature <= 0:
            given = [
                flag
                for flag, value in (
                    ("--top-p", self.top_p),
                    ("--top-k", self.top_k),
                    ("--seed", self.seed),
                    ("--acceptance", self.acceptance or None),
                )
                if value is not None
            ]
            if given:
                verb = "applies" if len(given) == 1 else "apply"
                raise MedusaError(f"{' / '.join(given)} {verb} when sampling: add --temperature (e.g. 0.7), or drop it for greedy decoding")

    def _check_peers(self) -> None:
        from medusa_trt.bench.peers import peer_missing

        specs = self.peer_specs()
        if specs and self.temperature > 0:
            raise MedusaError("--peer rows decode greedily: drop --temperature, or drop --peer")
        for text, spec in zip(self.peers, specs):
            missing = peer_missing(spec)
            if missing:
                raise MedusaError(f"--peer {text}: {missing}")

    def _check_repeats(self) -> None:
        """Refuse repeated options whose rows would overwrite each other."""
        names = [Path(e).stem for e in self.engines]
        for text in self.backends:
            backend_options(text)  # a bad one fails before any engine loads
        drafts = [",".join(d) or "none" for d in self.drafts]
        peers = [p.name for p in self.peer_specs()]
        for what, values in (
            ("--engine", names),
            ("--tree", list(self.trees)),
            ("--acceptance", list(self.acceptance)),
            ("--draft", drafts),
            ("--peer", peers),
            ("--backend", list(self.backends)),
        ):
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise MedusaError(
                    f"{what} {repeated[0]} is given twice: its rows would overwrite each other "
                    f"({'engines are named by file stem: rename one' if what == '--engine' else 'drop the repeat'})"
                )

    def peer_specs(self) -> list:
        """The peers as ``bench.peers.PeerSpec``, checked (PeerError)."""
        from medusa_trt.bench.peers import parse_peer

        return [parse_peer(text) for text in self.peers]

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    @property
    def rules(self) -> list[str | None]:
        """The medusa rows' acceptance rules: one row each (None: greedy)."""
        return (list(self.acceptance) or ["lossless"]) if self.sampled else [None]

    def sampling(self, rule: str | None, i: int) -> SamplingParams:
        """Prompt i's sampling: the same seed for every method."""
        return SamplingParams(self.temperature, self.top_p, self.top_k, seed=self.seed + i, acceptance=rule)


def run(config: BenchConfig) -> dict:
    """Run the benchmark and return its report (what ``medusa-bench --out`` writes as JSON)."""
    from tqdm.auto import tqdm

    prompts = read_prompts(config.prompts)[:: config.every][: config.limit]
    engines = [_engine(path, backend, config) for path in config.engines for backend in config.backends or [None]]
    first = next(iter(engines[0][2].values()))[0]
    prompts, ids = _fitting(prompts, first, engines, config.max_new_tokens)
    eos = sorted(first.eos)
    hf = hf_model(config.model or first.backend.meta.model, config.threads) if config.hf else None
    rows, plain_of = _warm_up(engines, ids[0], config)
    if hf is not None:
        rows["hf"], rows["hf-lookup"] = Row("hf"), Row("hf-lookup")
    peers = _peers(config, first, ids[0], eos, rows)
    try:
        for i, prompt in enumerate(tqdm(ids, desc="medusa-bench", unit="prompt", disable=None)):
            for name, plain, variants in engines:  # interleaved: drift in machine speed hits every method alike
                for key, (runtime, rule) in ((f"plain[{name}]", plain), *variants.items()):
                    result = runtime.generate(prompt, max_new_tokens=config.max_new_tokens, sampling=config.sampling(rule, i))
                    rows[key].add_result(result)
            for peer in peers:
                _peer_generate(peer, rows[peer.name], prompt, config.max_new_tokens, eos, f"on prompt {i + 1} of {len(ids)}")
            if hf is not None:
                rows["hf"].add(*hf_generate(hf, prompt, config.max_new_tokens, eos, None, config.sampling(None, i)))
                rows["hf-lookup"].add(*hf_generate(hf, prompt, config.max_new_tokens, eos, config.lookup_tokens, config.sampling(None, i)))
    finally:
        for peer in peers:
            peer.close()
    return _report(config, engines, first, len(prompts), rows, plain_of, hf is not None)


def backend_options(text: str) -> dict:
    """``NAME[:PRECISION]`` (``openvino:bf16``) as ``MedusaRuntime`` keywords, or MedusaError naming the fix."""
    from medusa_trt.runtime.backends import ONNX_BACKENDS

    name, _, precision = text.partition(":")
    if name not in ONNX_BACKENDS or (precision and name != "openvino"):
        raise MedusaError(
            f"--backend {text!r}: use one of {', '.join(ONNX_BACKENDS)}, with :PRECISION (f32, bf16) for openvino only "
            "(a .plan engine runs on tensorrt by itself)"
        )
    return dict(backend=name, precision=precision or None)


def _engine(path: str, backend: str | None, config: BenchConfig) -> tuple:
    """(name, (plain runtime, rule), {medusa row name: (runtime, rule)}): the rows of one engine on one backend
    (None: the engine's own), sharing one session. Named by the file stem, and ``@backend`` when one is named."""
    from medusa_trt.runtime import MedusaRuntime

    options = backend_options(backend) if backend else {}
    own = MedusaRuntime(path, max_batch=1, threads=config.threads, **options)
    name = Path(path).stem + (f"@{backend}" if backend else "")
    trees, drafts, rules = config.trees or [None], config.drafts or [None], config.rules
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
    return name, (own.plain(), rules[0]), variants


def _fitting(prompts: list[str], first, engines: list[tuple], max_new_tokens: int) -> tuple[list[str], list[list[int]]]:
    """The prompts and their token ids that leave room for ``max_new_tokens`` in every engine's context."""
    ids = [first.codec.encode(p, chat=first.is_chat) for p in prompts]
    room = min(rt.max_context for _, _, v in engines for rt, _ in v.values()) - max_new_tokens
    fits = [i for i, x in enumerate(ids) if len(x) <= room]
    if len(fits) < len(ids):
        log.warning(
            "skipping %d of %d prompts longer than %d tokens (the engine's context less --max-new-tokens)",
            len(ids) - len(fits),
            len(ids),
            room,
        )
        prompts, ids = [prompts[i] for i in fits], [ids[i] for i in fits]
    if not ids:
        raise MedusaError(
            f"no prompt fits the engine's context with --max-new-tokens {max_new_tokens}: "
            "export with a larger --max-context or lower --max-new-tokens"
        )
    return prompts, ids


def _warm_up(engines: list[tuple], prompt: list[int], config: BenchConfig) -> tuple[dict[str, Row], dict[str, str]]:
    """Every engine row, warmed up (first calls pay one-time costs), and each row's plain row."""
    rows: dict[str, Row] = {}
    plain_of: dict[str, str] = {}  # row -> the plain row of its engine
    for name, plain, variants in engines:
        for key, (runtime, rule) in ((f"plain[{name}]", plain), *variants.items()):
            rows[key], plain_of[key] = Row(key), f"plain[{name}]"
            runtime.generate(prompt, max_new_tokens=4, sampling=config.sampling(rule, 0))
    return rows, plain_of


def _peers(config: BenchConfig, first, prompt: list[int], eos: list[int], rows: dict[str, Row]) -> list:
    """The peer engines, each in a process of its own, ready and warmed up as the engines are; a row for
    each (one that died loading or warming up says so in its row, and is not asked again)."""
    from medusa_trt.bench.peer_process import PeerDied, PeerProcess

    peers = []
    try:
        for spec in config.peer_specs():
            rows[spec.name] = row = Row(spec.name)
            try:
                peer = PeerProcess(spec, threads=config.threads, context=first.max_context, vocab_size=first.backend.meta.vocab_size)
            except PeerDied as exc:
                row.fail(f"{exc}")
                log.warning("--peer %s: %s: its row is empty", spec.text, exc)
                continue
            peers.append(peer)
            row.mode = peer.mode
            _peer_generate(peer, row, prompt, 4, eos, "while warming up", warm_up=True)
    except BaseException:  # a bad --peer (PeerError) or an interrupt: no worker outlives the benchmark
        for peer in peers:
            peer.close()
        raise
    return peers


def _peer_generate(peer, row: Row, prompt: list[int], max_new_tokens: int, eos: list[int], where: str, warm_up: bool = False) -> None:
    """One peer's turn: its output into its row, or, where its worker died, the row's failure (it is then not asked again)."""
    from medusa_trt.bench.peer_process import PeerDied

    if row.failure:
        return
    try:
        tokens, seconds = peer.generate(prompt, max_new_tokens, frozenset(eos))
    except PeerDied as exc:
        row.fail(f"{exc} {where}")
        log.warning("--peer %s: %s %s: the rest of its row is skipped", peer.spec.text, exc, where)
        return
    if not warm_up:
        row.add(tokens, seconds)


def _report(
    config: BenchConfig, engines: list[tuple], first, prompts: int, rows: dict[str, Row], plain_of: dict[str, str], hf: bool
) -> dict:
    reference = rows[f"plain[{engines[0][0]}]"]
    sampling = {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
        "seed": config.seed,
        "acceptance": config.rules,
    }
    return {
        "engines": list(config.engines),
        "model": first.backend.meta.model,
        "tree": first.tree.name,
        "tree_nodes": first.tree.num_nodes,
        "trees": {
            key: {"name": rt.tree.name, "nodes": rt.tree.num_nodes, "drafters": list(rt.drafting.names)}
            for _, _, v in engines
            for key, (rt, _) in v.items()
        },
        "sampling": sampling if config.sampled else "greedy",
        "prompts": prompts,
        "prompts_file": str(config.prompts),
        "every": config.every,
        "max_new_tokens": config.max_new_tokens,
        "reference": reference.name,
        "methods": methods(rows, reference, plain_of, hf),
        "heads_cost": heads_cost(first),
    }
