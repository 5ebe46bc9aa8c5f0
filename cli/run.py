"""``medusa-run``: generate with Medusa from the command line and print a one-line summary.

    medusa-run --model smollm2-135m --heads DIR --prompt "Hello" [--tree mc_sim_7b_63]
    medusa-run --engine build/model.onnx --prompt "Hello" --temperature 0.7 --top-p 0.9 --seed 1
    medusa-run --engine build/model.onnx --messages chat.json     # a conversation through the chat template

``--messages FILE``: a JSON list of {"role": "system" | "user" | "assistant", "content": text}
turns (or an object whose "messages" holds it, as an OpenAI chat request does); the reply is
generated after the last turn. Repeat it for a batch of conversations.

An ``--engine`` folder or file is checked against its export's manifest before it runs: every
file's size and sha256 (as ``medusa-serve`` does), so a file corrupted in place is refused, not
run; ``--no-verify`` skips the sha256 sums (a second or so per GB of engine) and logs that it did.

Bad input (missing model, heads for another model, invalid tree, prompt too long, an engine file
that does not match its manifest) prints one ``medusa-run: error: ...`` line and exits 2.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass

from medusa_trt.cli.common import (
    USER_ERRORS,
    VERBOSE_HELP,
    Parser,
    add_backend_arg,
    add_sampling_args,
    drafter_list,
    entry,
    fail,
    positive_int,
    sampling_kwargs,
    setup_logging,
)
from medusa_trt.runtime.config import DEFAULT_MAX_NEW_TOKENS
from medusa_trt.runtime.text import PromptError

log = logging.getLogger("medusa_trt.cli.run")
WARM_UP_TOKENS = 4  # --compare-plain: tokens each runtime generates untimed first (medusa-bench warms up alike)


def build_parser() -> Parser:
    p = Parser(prog="medusa-run", description="Generate text with Medusa speculative decoding.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--engine", help="an exported engine: a folder, .onnx (ONNX Runtime; no torch needed) or .plan")
    source.add_argument("--model", help="smollm2-135m, a Hugging Face folder, or a .gguf file (torch backend)")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument("--heads", help="Medusa heads: our folder (heads.json) or a FasterDecoding/Medusa checkpoint folder")
    heads.add_argument(
        "--untrained-heads",
        type=int,
        metavar="N",
        help="N untrained heads (identity blocks + shared lm_head): shows the loop, not a speedup",
    )
    p.add_argument("--head-layer", type=int, help="decoder layer whose output feeds the heads (default: final hidden)")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    prompts.add_argument(
        "--messages",
        action="append",
        metavar="FILE",
        help="a conversation: a JSON list of {role, content} turns (system, user, assistant) rendered by the "
        "chat template; repeat for a batch",
    )
    p.add_argument(
        "--tree", help="the heads' template: preset name, chain-N, or a JSON file (default: the engine's, or a chain over the heads)"
    )
    p.add_argument(
        "--draft",
        type=drafter_list,
        metavar="LIST",
        help="drafters, comma-separated: heads, lookup, recycle; 'none' for plain decoding (default: every one the engine supports)",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=DEFAULT_MAX_NEW_TOKENS, help="new tokens per prompt, at most")
    p.add_argument("--stop", action="append", help="stop string; repeatable")
    p.add_argument("--no-chat-template", action="store_true", help="send plain prompts as they are to an instruct model")
    p.add_argument("--max-context", type=positive_int, help="default: the engine's, or 1024 for --model")
    p.add_argument("--max-batch", type=positive_int, help="default: the engine's, or 4 for --model")
    p.add_argument("--device", help="cpu or cuda (default: cpu)")
    add_backend_arg(p)
    p.add_argument("--precision", choices=["f32", "bf16"], help="openvino's precision (default f32; bf16 needs AMX or AVX512-BF16)")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the sha256 check of the --engine's files against its manifest (sizes are still checked): a faster start",
    )
    p.add_argument("--compare-plain", action="store_true", help="also decode without heads on the same engine and print the speedup")
    p.add_argument("--stream", action="store_true", help="print tokens as they are committed (single prompt)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt (text, token ids, finish reason, stats)")
    add_sampling_args(p)
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    return p


@dataclass(frozen=True)
class _Run:
    """One timed generation of the command's prompts: its summary line, speed, tokens and how each prompt ended."""

    line: str
    rate: float  # tokens/s
    token_ids: list  # per prompt
    finish: list  # per prompt: stop, length or cancelled


def _finished(reasons: list) -> str:
    """``finished: length`` for one prompt, ``finished: 2 stop, 1 length`` for several."""
    counts = {r: reasons.count(r) for r in dict.fromkeys(reasons)}
    return "finished: " + (reasons[0] if len(reasons) == 1 else ", ".join(f"{n} {r}" for r, n in counts.items()))


def _summary(results) -> _Run:
    tokens = sum(r.stats.new_tokens for r in results)
    steps = sum(r.stats.steps for r in results)
    per_step = [a for r in results for a in r.stats.accepted_per_step]
    mean = sum(per_step) / len(per_step) if per_step else 0.0
    seconds = results[0].stats.seconds
    rate = tokens / seconds if seconds else 0.0
    finish = [r.finish_reason for r in results]
    line = f"{tokens} tokens, {steps} steps, {mean:.2f} accepted/step, {rate:.1f} tokens/s; {_finished(finish)}"
    return _Run(line, rate, [r.token_ids for r in results], finish)


def _stream(runtime, prompt: str, gen: dict) -> _Run:
    """Print text as it is committed; the summary comes from the events (one per step)."""
    started, ids, steps, finish = time.perf_counter(), [], -1, None  # the first event is the prefill's token
    for event in runtime.stream(prompt, **gen):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        ids.extend(event.token_ids)
        steps, finish = steps + 1, event.finish_reason or finish
    sys.stdout.write("\n")
    rate = len(ids) / (time.perf_counter() - started)
    mean = (len(ids) - 1) / steps if steps > 0 else 0.0
    line = f"{len(ids)} tokens, {steps} steps, {mean:.2f} accepted/step, {rate:.1f} tokens/s; {_finished([finish])}"
    return _Run(line, rate, [ids], [finish])


def _what_ran(runtime) -> str:
    """The backend with its threads and instruction set, the engine's precision, and the drafting."""
    drafters = ",".join(runtime.drafting.names)
    drafting = f"drafters {drafters}, heads template {runtime.tree.name}" if drafters else "plain decoding (no drafters)"
    return f"{runtime.describe()}; {drafting}"


def _same_as_plain(drafted: _Run, plain: _Run) -> str:
    """Whether drafting kept the model's own output: token for token against plain decoding on the same engine."""
    differ = [i for i, (a, b) in enumerate(zip(drafted.token_ids, plain.token_ids)) if a != b]
    if not differ:
        return "drafted = plain: yes, token for token" + (f" on {len(plain.token_ids)} prompts" if len(plain.token_ids) > 1 else "")
    a, b = drafted.token_ids[differ[0]], plain.token_ids[differ[0]]
    first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    where = f"prompt {differ[0]} from token {first}" if len(plain.token_ids) > 1 else f"from token {first}"
    return f"drafted = plain: NO, {where} (greedy drafting on an exact engine gives the plain tokens; sampled drafting need not)"


def read_messages(path: str) -> list[dict]:
    """A conversation from a JSON file: a list of {role, content} turns, or {"messages": [...]}."""
    from pathlib import Path

    from medusa_trt.runtime.text import check_messages

    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise PromptError(f'--messages {path} is not valid JSON ({exc}): write a list of {{"role", "content"}} objects') from exc
    if isinstance(raw, dict) and "messages" in raw:
        raw = raw["messages"]
    return check_messages(raw, f"--messages {path}")


def _check_options(args) -> None:
    """Refuse options that would be silently ignored in this combination."""
    if args.messages and args.no_chat_template:
        raise PromptError("--messages is a conversation, which only the chat template renders: drop --no-chat-template")
    if args.stream and len(args.prompt or args.messages) > 1:
        raise PromptError("--stream prints one prompt's tokens as they come: pass one --prompt, or drop --stream for a batch")
    if args.json and (args.stream or args.compare_plain):
        raise PromptError("--json prints each whole result as one JSON object: drop --stream / --compare-plain")
    if args.engine and args.device:
        raise PromptError("--device goes with --model (torch backend); an --engine runs on ONNX Runtime's providers")
    if args.no_verify and not args.engine:
        raise PromptError("--no-verify skips an --engine's sha256 check: a --model has no manifest to check, drop it")


@entry("medusa-run")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        _check_options(args)
        from medusa_trt.runtime import MedusaRuntime, RuntimeConfig
        from medusa_trt.runtime.sampling import SamplingParams

        SamplingParams(**sampling_kwargs(args))  # bad sampling options fail before the model loads
        prompts = args.prompt or [read_messages(f) for f in args.messages]  # so does a bad --messages file

        device = args.device or "cpu"
        if args.engine:
            if args.heads or args.untrained_heads or args.head_layer is not None:
                raise PromptError("--heads / --untrained-heads / --head-layer go with --model; an engine carries its heads")
            model = args.engine
            if args.no_verify:
                log.warning("--no-verify: the sha256 sums of %s are not checked (only the file sizes)", args.engine)
        elif args.backend or args.precision:
            raise PromptError("--backend / --precision go with --engine; --model runs on torch")
        else:
            from medusa_trt.cli.common import load_model

            model = load_model(args.model, args.heads, args.untrained_heads, args.head_layer, device)
        config = RuntimeConfig(
            max_batch=args.max_batch,
            max_context=args.max_context,
            tree=args.tree,
            drafters=args.draft,
            device=None if args.engine else device,
            verify_checksums=bool(args.engine) and not args.no_verify,
            backend=args.backend,
            precision=args.precision,
        )
        runtime = MedusaRuntime(model, config)
        gen = dict(
            max_new_tokens=args.max_new_tokens,
            stop=args.stop,
            chat_template=False if args.no_chat_template else None,
            **sampling_kwargs(args),
        )
        if args.compare_plain:  # as medusa-bench: neither timed run pays the first calls' one-time costs
            for warm in (runtime, runtime.plain()):
                warm.generate(prompts[0], **(gen | {"max_new_tokens": WARM_UP_TOKENS}))
        if args.stream:
            drafted = _stream(runtime, prompts[0], gen)
        else:
            results = runtime.generate(prompts, **gen)
            if args.json:
                for r in results:
                    print(
                        json.dumps(
                            {
                                "text": r.text,
                                "token_ids": r.token_ids,
                                "finish_reason": r.finish_reason,
                                "steps": r.stats.steps,
                                "mean_accepted": r.stats.mean_accepted,
                                "tokens_per_s": r.stats.tokens_per_second,
                            }
                        )
                    )
                return 0
            for i, r in enumerate(results):
                if len(results) > 1:
                    print(f"--- prompt {i} ({r.finish_reason})")
                print(r.text)
            drafted = _summary(results)
        print(f"medusa on {_what_ran(runtime)}: {drafted.line}")
        if args.compare_plain:
            plain = _summary(runtime.plain().generate(prompts[:1] if args.stream else prompts, **gen))
            print(f"plain decoding (same engine): {plain.line}")
            print(_same_as_plain(drafted, plain))
            print(
                f"speedup over plain decoding: {drafted.rate / plain.rate:.2f}x in this one run "
                "(it moves with the machine's load: medusa-bench times many prompts, interleaved)"
            )
    except USER_ERRORS as exc:
        return fail("medusa-run", exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
