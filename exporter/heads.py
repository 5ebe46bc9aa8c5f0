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
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from medusa_trt.runtime.errors import MedusaError

log = logging.getLogger(__name__)

HEADS_CONFIG = "heads.json"
HEADS_WEIGHTS = "heads.safetensors"
FORMAT_VERSION = 2  # written for next-token-aware heads; hidden-only heads are still written as version 1
HEAD_INPUTS = ("hidden", "hidden+next")  # what the heads read: the hidden state | and the next token's embedding


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
        return self.head_input == "hidden+next"

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        if not self.reads_next:  # readable by version-1 loaders, as before
            fields.pop("head_input")
        return json.dumps({"format_version": FORMAT_VERSION if self.reads_next else 1, **fields}, indent=2)


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


def unit_rms(e: torch.Tensor) -> torch.Tensor:
    """``e`` scaled to unit root-mean-square over its last axis (an RMSNorm without weights)."""
    return e * torch.rsqrt(e.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(e.dtype)


class MedusaHeads(nn.Module):
    """``forward(hidden [..., H], next_ids [...] | None) -> logits [..., n, V]``; ``next_ids`` (the
    base model's next token at each hidden state) only for heads that read it.

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
            if config.reads_next:
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

    def blocks(self, hidden: torch.Tensor, next_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Every head's block output before the projection: (..., n, H)."""
        if self._embed is not None:
            if next_ids is None:
                raise HeadsMismatchError("these heads read the next token: pass next_ids")
            e = unit_rms(self._embed[0](next_ids)).to(hidden.dtype)  # (..., H)
        outs = []
        for head in self.heads:
            x = hidden
            for block in head[: self.config.num_layers]:
                x = block(x, e) if isinstance(block, NextBlock) else block(x)
            outs.append(x)
        return torch.stack(outs, dim=-2)  # (..., n, H)

    def projection_weights(self, vocab: int) -> list[torch.Tensor]:
        """The projection rows of the first ``vocab`` token ids: one [vocab, H] matrix for shared
        heads, one per head otherwise (views of the weights, no copy)."""
        if self._shared is not None:
            return [self._shared[0].weight[:vocab]]
        return [head[-1].weight[:vocab] for head in self.heads]

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor | None = None) -> torch.Tensor:
        blocks = self.blocks(hidden, next_ids)  # (..., n, H)
        if self._shared is not None:
            # one projection for all heads: the (large) lm_head is read once per call, and an
            # exported graph holds it once
            return self._shared[0](blocks)  # (..., n, V)
        return torch.stack([self.project(blocks[..., k, :], k) for k in range(len(self.heads))], dim=-2)  # (..., n, V)


def init_heads(config: HeadsConfig, lm_head: nn.Linear | None, *, seed: int = 0, random: bool = False,
               embed: nn.Module | None = None) -> MedusaHeads:
    """Heads ready to train: blocks start as the identity (zero weights) and an own projection
    starts as a copy of the base lm_head, as in the Medusa paper. ``random=True`` gives random
    blocks instead (tests: whatever the heads propose, greedy output must stay identical).
    ``embed``: the base model's input embedding, for next-token-aware heads."""
    gen = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(config, lm_head, embed)
    with torch.no_grad():
        for head in heads.heads:
            for block in head:
                if isinstance(block, (ResBlock, NextBlock)):
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


def save_heads(heads: MedusaHeads, folder: str | os.PathLike) -> Path:
    """Write ``heads.json`` + ``heads.safetensors`` atomically (temp folder, then rename)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    if not folder.parent.is_dir():
        raise HeadsFormatError(f"cannot write heads to {folder}: folder {folder.parent} does not exist")
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
        save_file(state, str(tmp / HEADS_WEIGHTS))
        (tmp / HEADS_CONFIG).write_text(heads.config.to_json())
        for path in (tmp, tmp / HEADS_WEIGHTS, tmp / HEADS_CONFIG):  # mkdtemp makes them private
            path.chmod(0o755 if path.is_dir() else 0o644)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


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
            folder, cfg.get("medusa_num_heads"), num_heads, num_heads,
        )
    if cfg.get("medusa_num_layers") not in (None, num_layers):
        log.warning("%s/config.json says medusa_num_layers=%s but the weights hold %d", folder, cfg["medusa_num_layers"], num_layers)
    if num_layers == 0 and shared:
        raise HeadsFormatError(f"Medusa heads in {folder} hold neither blocks nor projections")
    hidden = state["0.0.linear.weight"].shape[1] if num_layers else state["0.0.weight"].shape[1]
    vocab = state[f"0.{num_layers}.weight"].shape[0] if not shared else vocab_size
    return HeadsConfig(
        num_heads=num_heads, num_layers=num_layers, hidden_size=hidden, vocab_size=vocab,
        shared_lm_head=shared, base_model=str(cfg.get("base_model_name_or_path", "")),
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
        if version not in (1, 2):
            raise HeadsFormatError(f"{folder / HEADS_CONFIG} has format version {version}; this medusa-trt reads 1 and 2: upgrade it")
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
        raise HeadsFormatError(f"heads weights in {folder} do not match their config: missing {missing[:4]}, unexpected {extra[:4]}, wrong shape {bad[:4]}")
    heads.load_state_dict({f"heads.{k}": v for k, v in state.items()})
    return heads
