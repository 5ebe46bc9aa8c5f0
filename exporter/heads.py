"""Medusa heads: n heads on a hidden state, head k guessing the token k+1 steps past the next.

Head k = L residual blocks ``x + SiLU(W x + b)`` (each block its own weights: the reference
implementation's ``[ResBlock(h)] * L`` shares one block L times, a bug not repeated here),
then a vocabulary projection: the head's own ``Linear(H, V)`` or the base model's ``lm_head``.

Next-token-aware heads (``head_input = "hidden+next"``, format version 2): when the heads run,
the base model's choice of the next token (the root of the next tree) is already known, so the
first block of every head also reads its embedding, ``x + SiLU(W [x; rms(e)] + b)`` with ``e``
the base model's own frozen input embedding of that token (``rms``: scaled to unit RMS, no
weights). A Medusa head must predict a blend of the branches the next token may take; this
one knows which was taken (the gap Hydra and EAGLE close). All heads still fire in one call.

Sequential heads (``head_input = "hidden+path"``, format version 3, Hydra-style): head k's first
block reads the root and the k - 1 tokens drafted above its node, ``x + SiLU(W_k [x; rms(e_1);
...; rms(e_k)] + b)``, so head k guesses the token after a known path instead of a blend over
every path. Head 1 is a next-token-aware head (same weights and shapes). One heads call expands
a tree template depth by depth (:meth:`MedusaHeads.expand`): head d + 1 below each node of depth d
that has children, along the top-k tokens the heads above chose.

Formats read by :func:`load_heads`:
  * ours: ``heads.json`` (:class:`HeadsConfig`) + ``heads.safetensors`` in one folder;
  * FasterDecoding/Medusa: ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
    optional ``version: "2"`` = heads reuse the base ``lm_head``) + ``medusa_lm_head.pt`` or
    ``medusa_lm_head.safetensors`` with keys ``{head}.{layer}.linear.weight|bias`` and
    ``{head}.{L}.weight``. The weights are trusted over the config's head count.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from medusa_trt.runtime import durable
from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger(__name__)

HEADS_CONFIG = "heads.json"
HEADS_WEIGHTS = "heads.safetensors"
FORMAT_VERSION = 3  # written for sequential heads; next-token-aware heads as 2, hidden-only heads as 1 (older readers read them)
# what the heads read: the hidden state | and the next token's embedding | and the drafted path's embeddings
HEAD_INPUTS = ("hidden", "hidden+next", "hidden+path")
_VERSION_OF = {"hidden": 1, "hidden+next": 2, "hidden+path": 3}


class HeadsFormatError(MedusaError):
    """The heads file or folder cannot be read as Medusa heads."""


class HeadsMismatchError(MedusaError):
    """The heads do not fit the base model (hidden size, vocabulary or layer)."""


@dataclass(frozen=True)
class HeadsConfig:
    num_heads: int  # n: head k (1-based) guesses the token k+1 steps past the current one
    num_layers: int  # L: residual blocks per head
    hidden_size: int  # H of the base model's hidden state the heads read
    vocab_size: int  # V of the base model
    shared_lm_head: bool  # True: project with the base lm_head (Medusa-2 style), no own weights
    head_layer: int | None = None  # decoder layer whose output feeds the heads; None = final normed hidden
    base_model: str = ""  # informational: what the heads were trained on
    head_input: str = "hidden"  # one of HEAD_INPUTS

    def __post_init__(self):
        if self.head_input not in HEAD_INPUTS:
            raise HeadsFormatError(f"head_input {self.head_input!r} is not one of {', '.join(HEAD_INPUTS)}")

    @property
    def reads_next(self) -> bool:
        """The heads read the next token (the root of the next tree)."""
        return self.head_input != "hidden"

    @property
    def reads_path(self) -> bool:
        """Head k also reads the k - 1 tokens drafted above its node (sequential heads)."""
        return self.head_input == "hidden+path"

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        if not self.reads_next:  # readable by version-1 loaders, as before
            fields.pop("head_input")
        return json.dumps({"format_version": _VERSION_OF[self.head_input], **fields}, indent=2)


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class NextBlock(nn.Module):
    """The first block of a next-token-aware head: ``x + SiLU(W [x; rms(e)] + b)``."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(2 * hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(torch.cat([x, e], dim=-1)))


class PathBlock(nn.Module):
    """The first block of a sequential head that reads ``tokens`` embeddings (root first):
    ``x + SiLU(W [x; rms(e_1); ...; rms(e_tokens)] + b)``. With one token it is a :class:`NextBlock`."""

    def __init__(self, hidden_size: int, tokens: int):
        super().__init__()
        self.linear = nn.Linear((1 + tokens) * hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """x [..., H], e [..., tokens, H] -> [..., H]."""
        return x + self.act(self.linear(torch.cat([x, e.flatten(-2)], dim=-1)))


def unit_rms(e: torch.Tensor) -> torch.Tensor:
    """``e`` scaled to unit root-mean-square over its last axis (an RMSNorm without weights)."""
    return e * torch.rsqrt(e.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(e.dtype)


class MedusaHeads(nn.Module):
    """``forward(hidden [..., H], next_ids [...] | None, path [..., n-1] | None) -> logits [..., n, V]``;
    ``next_ids`` (the base model's next token at each hidden state) only for heads that read it,
    ``path`` (the tokens at depths 1..n-1 of one drafted path) only for sequential heads.

    State-dict keys follow the FasterDecoding layout under ``heads.``: ``heads.{k}.{l}.linear.*``
    for the blocks and ``heads.{k}.{L}.weight`` for an own projection. A shared ``lm_head`` and the
    input embedding are held outside the module tree (they belong to the base model and are
    neither saved nor trained here).
    """

    def __init__(self, config: HeadsConfig, lm_head: nn.Module | None = None, embed: nn.Module | None = None):
        super().__init__()
        if config.shared_lm_head and lm_head is None:
            raise HeadsMismatchError("these heads share the base model's lm_head: pass it as lm_head=")
        if config.reads_next and embed is None:
            raise HeadsMismatchError("these heads read the next token's embedding: pass the base model's input embedding as embed=")
        if config.reads_next and config.num_layers < 1:
            raise HeadsFormatError("next-token-aware heads need at least one block (num_layers >= 1)")
        self.config = config
        heads = []
        for _ in range(config.num_heads):
            blocks: list[nn.Module] = [ResBlock(config.hidden_size) for _ in range(config.num_layers)]
            if config.reads_path:
                blocks[0] = PathBlock(config.hidden_size, len(heads) + 1)  # head k reads the root and k - 1 drafts
            elif config.reads_next:
                blocks[0] = NextBlock(config.hidden_size)
            if not config.shared_lm_head:
                blocks.append(nn.Linear(config.hidden_size, config.vocab_size, bias=False))
            heads.append(nn.ModuleList(blocks))
        self.heads = nn.ModuleList(heads)
        self._shared = (lm_head,) if config.shared_lm_head else None  # tuple: not registered as a child
        self._embed = (embed,) if config.reads_next else None

    @property
    def base_lm_head(self) -> nn.Module | None:
        """The base model's lm_head these heads project with (shared heads), else None."""
        return self._shared[0] if self._shared is not None else None

    def project(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Vocabulary logits of head k's block output x [..., H] -> [..., V]."""
        if self._shared is not None:
            return self._shared[0](x)
        return self.heads[k][-1](x)

    def _embedded(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return unit_rms(self._embed[0](ids)).to(dtype)  # (..., H)

    def _run(self, k: int, hidden: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        x = hidden
        for block in self.heads[k][: self.config.num_layers]:
            x = block(x, e) if isinstance(block, (NextBlock, PathBlock)) else block(x)
        return x

    def blocks(self, hidden: torch.Tensor, next_ids: torch.Tensor | None = None, path: torch.Tensor | None = None) -> torch.Tensor:
        """Every head's block output before the projection: (..., n, H). Sequential heads read one
        path: head k the root ``next_ids`` and ``path[..., :k-1]``."""
        e = None
        if self._embed is not None:
            if next_ids is None:
                raise HeadsMismatchError("these heads read the next token: pass next_ids")
            if self.config.reads_path:
                if path is None or path.shape[-1] < self.config.num_heads - 1:
                    raise HeadsMismatchError(f"sequential heads read a drafted path: pass path [..., {self.config.num_heads - 1}]")
                e = self._embedded(torch.cat([next_ids[..., None], path[..., : self.config.num_heads - 1]], dim=-1), hidden.dtype)
                return torch.stack([self._run(k, hidden, e[..., : k + 1, :]) for k in range(len(self.heads))], dim=-2)
            e = self._embedded(next_ids, hidden.dtype)  # (..., H)
        return torch.stack([self._run(k, hidden, e) for k in range(len(self.heads))], dim=-2)  # (..., n, H)

    def head_logits(self, k: int, hidden: torch.Tensor, tokens: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
        """Head k's (0-based) logits over the first ``vocab`` ids (default all) at nodes whose path
        from the root is ``tokens`` [..., k+1] (root first; next-token-aware heads read the root only):
        hidden [..., H] -> [..., vocab]."""
        if self.config.reads_path:
            e = self._embedded(tokens[..., : k + 1], hidden.dtype)  # (..., k+1, H)
        elif self.config.reads_next:
            e = self._embedded(tokens[..., 0], hidden.dtype)
        else:
            e = None
        return self.projector(vocab)(k, self._run(k, hidden, e))  # (..., vocab)

    def projector(self, vocab: int | None = None):
        """``project(k, x)``: head k's logits over the first ``vocab`` ids (default all) of its block
        output x [..., H] -> [..., vocab], reading only those projection rows."""
        weights = self.projection_weights(vocab or self.config.vocab_size)
        return lambda k, x: torch.nn.functional.linear(x, weights[0 if self._shared is not None else k])

    def expand(self, hidden: torch.Tensor, roots: torch.Tensor, plan, top_k: int, project=None) -> torch.Tensor:
        """Sequential heads over a template's expansion (``runtime.drafting.sequential.Expansion``):
        head 1 at the root ``roots`` [B], then head d + 1 at each expanded node of depth d, reading
        the path of top-``top_k`` tokens that leads there. hidden [B, H] -> logits [B, P, N], row i
        the proposals below expanded node i. ``project(k, x)``: head k's projection (default: the
        whole vocabulary; :meth:`projector` gives a draft vocabulary's)."""
        if not self.config.reads_path:
            raise HeadsMismatchError("only sequential heads (head_input hidden+path) expand a template")
        project = project or self.projector()
        batch = hidden.shape[0]
        paths: list[torch.Tensor | None] = [None] * plan.rows  # row -> [B, depth+1] tokens, root first
        tops: list[torch.Tensor | None] = [None] * plan.rows  # row -> [B, K]
        logits: list[torch.Tensor | None] = [None] * plan.rows  # row -> [B, N]
        for depth, rows in enumerate(plan.levels()):
            level = []
            for r in rows:
                if depth == 0:
                    level.append(roots[:, None])  # (B, 1)
                else:
                    up, rank = int(plan.parent[r]), int(plan.rank[r])
                    level.append(torch.cat([paths[up], tops[up][:, rank : rank + 1]], dim=1))  # (B, depth+1)
            tokens = torch.stack(level, dim=1)  # (B, m, depth+1)
            e = self._embedded(tokens, hidden.dtype)  # (B, m, depth+1, H)
            x = self._run(depth, hidden[:, None, :].expand(batch, len(rows), hidden.shape[-1]), e)  # (B, m, H)
            out = project(depth, x).float()  # (B, m, N)
            top = out.topk(top_k, dim=-1).indices  # (B, m, K)
            for j, r in enumerate(rows):
                paths[r], tops[r], logits[r] = tokens[:, j], top[:, j], out[:, j]
        return torch.stack(logits, dim=1)  # (B, P, N)

    def projection_weights(self, vocab: int) -> list[torch.Tensor]:
        """The projection rows of the first ``vocab`` token ids: one [vocab, H] matrix for shared
        heads, one per head otherwise (views of the weights, no copy)."""
        if self._shared is not None:
            return [self._shared[0].weight[:vocab]]
        return [head[-1].weight[:vocab] for head in self.heads]

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor | None = None, path: torch.Tensor | None = None) -> torch.Tensor:
        blocks = self.blocks(hidden, next_ids, path)  # (..., n, H)
        if self._shared is not None:
            # one projection for all heads: the (large) lm_head is read once per call, and an
            # exported graph holds it once
            return self._shared[0](blocks)  # (..., n, V)
        return torch.stack([self.project(blocks[..., k, :], k) for k in range(len(self.heads))], dim=-2)  # (..., n, V)


def init_heads(
    config: HeadsConfig, lm_head: nn.Linear | None, *, seed: int = 0, random: bool = False, embed: nn.Module | None = None
) -> MedusaHeads:
    """Heads ready to train: blocks start as the identity (zero weights) and an own projection
    starts as a copy of the base lm_head, as in the Medusa paper. ``random=True`` gives random
    blocks instead (tests: whatever the heads propose, greedy output must stay identical).
    ``embed``: the base model's input embedding, for next-token-aware heads."""
    gen = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(config, lm_head, embed)
    with torch.no_grad():
        for head in heads.heads:
            for block in head:
                if isinstance(block, (ResBlock, NextBlock, PathBlock)):
                    if random:
                        block.linear.weight.normal_(0.0, block.linear.in_features**-0.5, generator=gen)
                        block.linear.bias.normal_(0.0, 0.02, generator=gen)
                    else:
                        block.linear.weight.zero_()
                        block.linear.bias.zero_()
                elif lm_head is not None and block.weight.shape == lm_head.weight.shape:
                    block.weight.copy_(lm_head.weight)
                else:
                    block.weight.normal_(0.0, config.hidden_size**-0.5, generator=gen)
    return heads


def save_heads(heads: MedusaHeads, folder: str | os.PathLike, *, extra: dict[str, str] | None = None) -> Path:
    """Write ``heads.json`` + ``heads.safetensors`` (+ ``extra``: file name -> text, such as
    medusa-train's train_config.json) and ``files.json``, the folder's manifest, whole: staged
    beside it, then swapped in (``runtime/durable.py``). An earlier heads folder there is replaced
    only if its manifest lists every file in it (its export.json and the tree file it names travel
    into the new folder), and removed only once the new one is in place."""
    from safetensors.torch import save_file

    from medusa_trt.runtime.manifest import write_folder_manifest

    folder = Path(folder)
    if not folder.parent.is_dir():
        raise HeadsFormatError(f"cannot write heads to {folder}: folder {folder.parent} does not exist")
    check_heads_out(folder)
    with durable.staged_folder(folder) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
        save_file(state, str(tmp / HEADS_WEIGHTS))
        (tmp / HEADS_CONFIG).write_text(heads.config.to_json())
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        _keep_export_defaults(folder, tmp)
        write_folder_manifest(tmp, "heads")
        check_heads_out(folder)  # once more: a file may have been added while the heads were written
    return folder


def check_heads_out(folder: str | os.PathLike, flag: str = "--out") -> None:
    """Raise unless ``folder`` may receive heads: it does not exist, is empty, or is a heads folder
    whose files.json lists every file in it (export.json and its tree file travel along). Heads
    folders written before folders carried files.json are refused with the way on, never deleted."""
    folder = Path(folder)
    if folder.is_dir() and not (folder / durable.FOLDER_MANIFEST).is_file() and (folder / HEADS_CONFIG).is_file():
        raise HeadsFormatError(
            f"{flag} {folder} holds heads written before heads folders listed their files (no {durable.FOLDER_MANIFEST}), "
            f"so nothing proves every file in it is ours: move it aside (mv {folder} {folder}.old) or pass another {flag}"
        )
    durable.check_folder_ours(folder, kind="heads", flag=flag, keep=_carried(folder))


def _carried(old: Path) -> list[str]:
    """What a rewrite of heads folder ``old`` carries into the new one: its export.json and the tree
    file that names (``exporter/export_defaults.py``): the settings the folder's engines are exported with."""
    from medusa_trt.exporter.export_defaults import EXPORT_DEFAULTS

    if not (old / EXPORT_DEFAULTS).is_file():
        return []
    try:
        tree = json.loads((old / EXPORT_DEFAULTS).read_text(encoding="utf-8")).get("tree")
    except (ValueError, AttributeError, OSError):
        return [EXPORT_DEFAULTS]  # a broken file travels as it is; the export names it
    if isinstance(tree, str) and tree.endswith(".json") and (old / tree).is_file() and Path(tree).name == tree:
        return [EXPORT_DEFAULTS, tree]
    return [EXPORT_DEFAULTS]


def _keep_export_defaults(old: Path, new: Path) -> None:
    """Heads retrained into the same folder keep its export.json and the tree file it names."""
    for name in _carried(old):
        shutil.copyfile(old / name, new / name)


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reader failure means an unreadable file
        raise HeadsFormatError(f"cannot read heads weights {path}: {exc}") from exc


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise HeadsFormatError(f"cannot read heads config {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise HeadsFormatError(f"heads config {path} is not a JSON object")
    return raw


def _check_fit(config: HeadsConfig, hidden_size: int, vocab_size: int, num_decoder_layers: int | None) -> None:
    if config.hidden_size != hidden_size:
        raise HeadsMismatchError(
            f"heads expect hidden size {config.hidden_size} but the base model has {hidden_size}: "
            "these heads were trained for another model"
        )
    if config.vocab_size != vocab_size:
        raise HeadsMismatchError(
            f"heads predict a vocabulary of {config.vocab_size} but the base model has {vocab_size}: "
            "these heads were trained for another model"
        )
    if config.head_layer is not None and num_decoder_layers is not None:
        if not 0 <= config.head_layer < num_decoder_layers:
            raise HeadsMismatchError(
                f"heads read decoder layer {config.head_layer} but the base model has layers 0..{num_decoder_layers - 1}"
            )


_FD_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _fasterdecoding_config(folder: Path, state: dict[str, torch.Tensor], vocab_size: int) -> HeadsConfig:
    """Infer n and L from the weights (configs in the wild sometimes give the wrong head count)."""
    cfg = _read_json(folder / "config.json")
    heads: dict[int, set[int]] = {}
    for key in state:
        m = _FD_KEY.match(key)
        if not m:
            raise HeadsFormatError(f"unexpected key {key!r} in Medusa heads {folder}: expected '{{head}}.{{layer}}.linear.weight'")
        heads.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if not heads or sorted(heads) != list(range(len(heads))):
        raise HeadsFormatError(f"Medusa heads in {folder} are not numbered 0..n-1: {sorted(heads)}")
    num_heads = len(heads)
    proj = [k for k in state if k.endswith(".weight") and not k.endswith("linear.weight")]
    linear_layers = {int(_FD_KEY.match(k).group(2)) for k in state if "linear" in k}
    num_layers = len(linear_layers)
    shared = not proj
    if str(cfg.get("version", "1")) == "2" and not shared:
        log.warning("config says version 2 (shared lm_head) but %s holds own projections: using them", folder)
    if cfg.get("medusa_num_heads") not in (None, num_heads):
        log.warning(
            "%s/config.json says medusa_num_heads=%s but the weights hold %d heads: using %d",
            folder,
            cfg.get("medusa_num_heads"),
            num_heads,
            num_heads,
        )
    if cfg.get("medusa_num_layers") not in (None, num_layers):
        log.warning("%s/config.json says medusa_num_layers=%s but the weights hold %d", folder, cfg["medusa_num_layers"], num_layers)
    if num_layers == 0 and shared:
        raise HeadsFormatError(f"Medusa heads in {folder} hold neither blocks nor projections")
    hidden = state["0.0.linear.weight"].shape[1] if num_layers else state["0.0.weight"].shape[1]
    vocab = state[f"0.{num_layers}.weight"].shape[0] if not shared else vocab_size
    return HeadsConfig(
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        shared_lm_head=shared,
        base_model=str(cfg.get("base_model_name_or_path", "")),
    )


def load_heads(
    path: str | os.PathLike,
    *,
    hidden_size: int,
    vocab_size: int,
    lm_head: nn.Module | None,
    num_decoder_layers: int | None = None,
    head_layer: int | None = None,
    embed: nn.Module | None = None,
) -> MedusaHeads:
    """Load heads (ours, version 1 or 2, or FasterDecoding) and check them against the base model first.

    ``head_layer`` overrides where heads attach (FasterDecoding checkpoints don't say: final hidden).
    ``embed``: the base model's input embedding, needed by next-token-aware heads.
    """
    folder = Path(path)
    if not folder.exists():
        raise HeadsFormatError(f"heads path {folder} does not exist")
    if folder.is_file():
        folder = folder.parent
    if (folder / HEADS_CONFIG).is_file():
        raw = _read_json(folder / HEADS_CONFIG)
        version = raw.pop("format_version", 1)
        if version not in (1, 2, 3):
            raise HeadsFormatError(f"{folder / HEADS_CONFIG} has format version {version}; this medusa-trt reads 1 to 3: upgrade it")
        try:
            config = HeadsConfig(**raw)
        except TypeError as exc:
            raise HeadsFormatError(f"{folder / HEADS_CONFIG} is not a heads config: {exc}") from exc
        state = _read_state(folder / HEADS_WEIGHTS)
        state = {k.removeprefix("heads."): v for k, v in state.items()}
    elif (folder / "config.json").is_file() and any((folder / f).is_file() for f in ("medusa_lm_head.pt", "medusa_lm_head.safetensors")):
        weights = folder / "medusa_lm_head.safetensors"
        if not weights.is_file():
            weights = folder / "medusa_lm_head.pt"
        state = _read_state(weights)
        config = _fasterdecoding_config(folder, state, vocab_size)
    else:
        raise HeadsFormatError(
            f"{folder} holds no Medusa heads: expected {HEADS_CONFIG} + {HEADS_WEIGHTS} (ours) or "
            "config.json + medusa_lm_head.pt|.safetensors (FasterDecoding/Medusa)"
        )
    if head_layer is not None:
        config = dataclasses.replace(config, head_layer=head_layer)
    _check_fit(config, hidden_size, vocab_size, num_decoder_layers)
    heads = MedusaHeads(config, lm_head if config.shared_lm_head else None, embed if config.reads_next else None)
    expected = {k.removeprefix("heads."): v.shape for k, v in heads.state_dict().items()}
    got = {k: v.shape for k, v in state.items()}
    if expected != got:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        bad = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
        raise HeadsFormatError(
            f"heads weights in {folder} do not match their config: missing {missing[:4]}, unexpected {extra[:4]}, wrong shape {bad[:4]}"
        )
    heads.load_state_dict({f"heads.{k}": v for k, v in state.items()})
    return heads
