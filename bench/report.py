"""``medusa-bench``'s report: per-row tallies, the JSON report and its plot, the printed table."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from medusa_trt.bench.files import staged
from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger(__name__)


class Row:
    """One method's tallies over the prompts: tokens, seconds, steps and every output's token ids."""

    def __init__(self, name: str, mode: str = ""):
        self.name, self.tokens, self.seconds, self.steps = name, 0, 0.0, []
        self.verify_seconds = self.heads_seconds = self.host_seconds = 0.0
        self.drafted = 0  # draft tokens verified (tree nodes past the root), summed over steps
        self.outputs: list[list[int]] = []
        self.mode = mode  # what ran, where a row says (a peer's: "extra buffer types off", "f32 precision")
        self.failure: str | None = None  # how the row ended early (a peer's worker died): its tallies cover the prompts before

    def fail(self, how: str) -> None:
        """The row ends here (its peer died): what it has so far stays, and the report says how it ended."""
        self.failure = how

    def add(
        self,
        token_ids: list[int],
        seconds: float,
        accepted: list[int] | None = None,
        verify: float = 0.0,
        heads: float = 0.0,
        host: float = 0.0,
        drafted: int = 0,
    ):
        self.host_seconds += host
        self.drafted += drafted
        self.tokens += len(token_ids)
        self.seconds += seconds
        self.steps += accepted or []
        self.verify_seconds += verify
        self.heads_seconds += heads
        self.outputs.append(list(token_ids))

    def add_result(self, result) -> None:
        """One ``MedusaRuntime.generate`` result: its tokens and step statistics."""
        s = result.stats
        self.add(result.token_ids, s.seconds, s.accepted_per_step, s.verify_seconds, s.heads_seconds, s.host_seconds, s.drafted_tokens)

    def report(self, reference: Row, own: Row | None = None) -> dict:
        """Rates and agreement: with ``reference`` (the first engine's plain decoding) and with
        ``own``, the plain decoding of this row's engine (None for the transformers rows)."""
        # a row that ended early (its peer died) is compared on the prompts it finished
        same = [a == b for a, b in zip(self.outputs, reference.outputs)]
        prefix = [_common_prefix(a, b) / max(len(b), 1) for a, b in zip(self.outputs, reference.outputs)]
        own_same = [a == b for a, b in zip(self.outputs, own.outputs)] if own is not None else []
        extra = {"mode": self.mode} if self.mode else {}
        if self.failure is not None:
            extra |= {"failure": self.failure, "prompts_done": f"{len(self.outputs)}/{len(reference.outputs)}"}
        return extra | {
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "new_tokens": self.tokens,
            "seconds": self.seconds,
            "mean_accepted_per_step": float(np.mean(self.steps)) if self.steps else None,
            "mean_nodes_per_step": 1 + self.drafted / len(self.steps) if self.steps else None,  # the verify tree, root included
            "heads_share_of_step_time": self.heads_seconds / (self.verify_seconds + self.heads_seconds) if self.verify_seconds else None,
            "host_ms_per_step": 1000 * self.host_seconds / len(self.steps) if self.steps else None,
            "identical_to_reference": float(np.mean(same)) if same else 0.0,
            "matching_prefix_fraction": float(np.mean(prefix)) if prefix else 0.0,
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


def methods(rows: dict[str, Row], reference: Row, plain_of: dict[str, str], hf: bool) -> dict[str, dict]:
    """Every row's report, with its speed against the reference, its own engine's plain row and (``hf``) transformers."""
    out = {k: r.report(reference, rows.get(plain_of.get(k))) for k, r in rows.items()}
    base_rate = out[reference.name]["tokens_per_s"]
    for name, m in out.items():
        m["speedup_vs_plain"] = m["tokens_per_s"] / base_rate if base_rate else None
        own_rate = out[plain_of[name]]["tokens_per_s"] if name in plain_of else None
        m["speedup_vs_own_plain"] = m["tokens_per_s"] / own_rate if own_rate else None
        if hf:
            m["speedup_vs_hf"] = m["tokens_per_s"] / out["hf"]["tokens_per_s"]
    return out


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


def write_report(report: dict, out: Path) -> list[Path]:
    """The JSON report at ``out`` and the plot beside it, each written whole or not at all; returns what was written."""
    png = out.with_suffix(".png")
    try:
        with staged(out, png) as (tmp_json, tmp_png):
            tmp_json.write_text(json.dumps(report, indent=2))
            plotted = plot(report, tmp_png)
    except OSError as exc:  # a full disk, a folder that went away: nothing was left behind
        raise MedusaError(
            f"cannot write {out}: {exc.strerror or exc}: check the folder (free space, permissions) or pick another --out"
        ) from exc
    return [out, png] if plotted else [out]


def table_lines(report: dict, written: list[Path]) -> list[str]:
    """The table ``medusa-bench`` prints: a heading, one line per method, the heads cost and what was written."""
    lines = [
        f"{report['prompts']} prompts x {report['max_new_tokens']} new tokens, tree {report['tree']} ({report['tree_nodes']} nodes), "
        f"agreement vs {report['reference']}",
        # vs plain / identical / prefix: against the reference; vs own / = own plain: against the plain row of the row's engine
        f"{'method':<48}{'tok/s':>8}{'acc/step':>10}{'vs plain':>10}{'vs own':>8}{'vs hf':>8}{'identical':>11}{'prefix':>8}"
        f"{'= own plain':>13}{'host ms/step':>14}  mode",
    ]
    greedy = report["sampling"] == "greedy"  # samples differ by design: agreement columns only for greedy decoding
    lines += [_method_line(name, m, greedy) for name, m in report["methods"].items()]
    cost = report["heads_cost"]
    if cost:
        lines.append(
            f"heads cost: {cost['heads_one_node_ms']:.1f} ms at the accepted node vs {cost['heads_all_nodes_ms']:.1f} ms on all "
            f"{cost['tree_nodes']} nodes; one verify step {cost['verify_step_ms_ctx128']:.1f} ms "
            f"({cost['verify_3_nodes_ms_ctx128']:.1f} ms with 3 nodes)"
        )
    if written:
        lines.append("wrote " + " and ".join(str(p) for p in written))
    return lines


def _method_line(name: str, m: dict, greedy: bool) -> str:
    acc = f"{m['mean_accepted_per_step']:.2f}" if m["mean_accepted_per_step"] else "-"
    vs_hf = f"{m['speedup_vs_hf']:.2f}x" if m.get("speedup_vs_hf") else "-"
    vs_own = f"{m['speedup_vs_own_plain']:.2f}x" if m.get("speedup_vs_own_plain") else "-"
    same = f"{m['identical_to_reference']:.0%}" if greedy else "-"
    prefix = f"{m['matching_prefix_fraction']:.0%}" if greedy else "-"
    own = m.get("identical_to_own_plain_prompts") if greedy and m.get("identical_to_own_plain_prompts") else "-"
    host = f"{m['host_ms_per_step']:.2f}" if m.get("host_ms_per_step") is not None else "-"
    # the mode that ran (a peer's), and how a row ended early: its figures cover the prompts before
    notes = "; ".join(n for n in (m.get("mode"), m.get("failure") and f"DIED {m['failure']} ({m['prompts_done']} prompts)") if n)
    return (
        f"{name:<48}{m['tokens_per_s']:>8.1f}{acc:>10}{m['speedup_vs_plain']:>9.2f}x{vs_own:>8}{vs_hf:>8}{same:>11}{prefix:>8}"
        f"{own:>13}{host:>14}" + (f"  {notes}" if notes else "")
    ).rstrip()
