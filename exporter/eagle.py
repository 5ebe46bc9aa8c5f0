"""EAGLE-3-style draft heads: one decoder layer of the base model's own architecture that drafts token after token
from the base model's hidden states of a low, a middle and a high layer (Li et al., "EAGLE-3", 2025).

A draft step at tree node p, whose token y is known and whose parent's state is f:

    features    step 0 (p a committed position): fc([h_low; h_mid; h_high])  (B, n, 3H) -> (B, n, H), the base's
                own hidden states at p; deeper: f, the drafter's output at p's parent
    x           fuse([rms(embed(y)); rms(features)])   (B, n, 2H) -> (B, n, H); ``embed`` is the base's frozen input
                embedding, ``rms`` a unit-RMS scaling without weights
    g           layer(x) over the keys and values so far  (B, n, H): the base's decoder-layer class, its own weights
    logits      lm_head(norm(g))   (B, n, draft_vocab); ``d2t[i]`` is draft id i's token id

``g`` is the next step's ``features`` below p. The keys and values a step attends to are the drafter's own:
those of the committed positions (step 0, one per position), and those of p's ancestors in the draft tree. At
training time the unrolled steps see exactly that (``ttt_mask``): the training-time test of EAGLE-3.

Weights are ours (``eagle.json`` + ``eagle.safetensors``, written whole or not at all); the base model's embedding
and rotary tables are read from the base, never copied.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from medusa_trt.runtime import durable
from medusa_trt.runtime.errors import MedusaError

EAGLE_CONFIG = "eagle.json"
EAGLE_WEIGHTS = "eagle.safetensors"
FORMAT = "eagle3"


class EagleFormatError(MedusaError):
    """A folder that is not an EAGLE-3-style drafter of this format, or one that does not fit the base model."""


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int  # H of the base model
    vocab_size: int  # V of the base model
    draft_vocab: int  # tokens the drafter can propose (d2t maps them to token ids)
    layers: tuple[int, ...]  # the base's decoder layers whose outputs feed fc, low to high
    base_model: str = ""  # informational: what the drafter was trained on
    format: str = FORMAT

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        if self.format != FORMAT:
            raise EagleFormatError(f"format {self.format!r} is not {FORMAT!r}")
        if not 0 < self.draft_vocab <= self.vocab_size:
            raise EagleFormatError(f"draft_vocab {self.draft_vocab} must be in 1..{self.vocab_size} (the base's vocabulary)")
        if not self.layers:
            raise EagleFormatError("layers is empty: name the base's decoder layers that feed the drafter")


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice: the third layer, the middle one and the third from the top."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class DraftKeys:
    """The keys and values one drafter step attends to: those given, then the step's own, appended by the attention
    (the one method of a transformers ``Cache`` the attention calls). Shapes (B, H_kv, slots, D)."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        self.keys, self.values = keys, values
        self.new_keys = self.new_values = None

    def update(self, keys, values, layer_idx, *args, **kwargs):
        self.new_keys, self.new_values = keys, values
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        return keys, values


class EagleDrafter(nn.Module):
    """The drafter's own weights and its draft step; the base model lends its embedding, rotary table and layer class."""

    def __init__(self, config: EagleConfig, base_model: nn.Module):
        super().__init__()
        self.config = config
        H, hf = config.hidden_size, base_model.config
        if (hf.hidden_size, hf.vocab_size) != (H, config.vocab_size):
            raise EagleFormatError(
                f"the drafter is for hidden size {H} and vocabulary {config.vocab_size}; the base model has "
                f"{hf.hidden_size} and {hf.vocab_size}: train a drafter for this model"
            )
        if max(config.layers) >= hf.num_hidden_layers:
            raise EagleFormatError(f"layers {config.layers} reach past the base's {hf.num_hidden_layers} decoder layers")
        layer_config = copy.deepcopy(hf)
        layer_config._attn_implementation = "sdpa"  # an additive float mask, any key layout (DraftKeys)
        decoder = base_model.model.layers[0]
        self.fc = nn.Linear(len(config.layers) * H, H, bias=False)
        self.fuse = nn.Linear(2 * H, H, bias=False)
        self.layer = type(decoder)(layer_config, layer_idx=0)
        self.norm = copy.deepcopy(base_model.model.norm)
        self.lm_head = nn.Linear(H, config.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.arange(config.draft_vocab), persistent=True)
        self._base = (base_model,)  # not a submodule: its weights are neither trained nor saved

    @property
    def base(self) -> nn.Module:
        return self._base[0]

    def init_from_base(self, d2t: torch.Tensor) -> None:
        """Start from the base: fc passing the highest feeding layer's state, fuse passing fc's, the layer a copy of
        that base layer, the norm and lm_head rows the base's own; ``d2t`` (draft_vocab,) the token ids proposed."""
        self.d2t.copy_(d2t)
        top = self.base.model.layers[max(self.config.layers)]
        self.layer.load_state_dict(top.state_dict())
        with torch.no_grad():
            self.lm_head.weight.copy_(self.base.get_output_embeddings().weight[d2t])
            H = self.config.hidden_size
            self.fuse.weight.zero_()
            self.fuse.weight[:, H:] = torch.eye(H)  # starts as the features alone
            self.fc.weight.zero_()
            self.fc.weight[:, -H:] = torch.eye(H)  # starts as the highest layer's state

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, n, len(layers) * H) the base's states at committed positions -> (B, n, H) step 0's features."""
        return self.fc(hidden)

    def step(
        self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, keys: DraftKeys
    ) -> torch.Tensor:
        """One draft step of n nodes: tokens (B, n) int64, features (B, n, H), positions (B, n) int64, mask (B, 1, n,
        slots) additive float over ``keys``' slots then the n new ones -> g (B, n, H); ``keys.new_keys`` holds theirs."""
        embed = self.base.get_input_embeddings()(tokens)
        x = self.fuse(torch.cat([_rms(embed), _rms(features)], dim=-1))
        rotary = self.base.model.rotary_emb(x, positions)
        return self.layer(x, attention_mask=mask, position_ids=positions, cache=keys, position_embeddings=rotary)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """(B, n, H) -> (B, n, draft_vocab)."""
        return self.lm_head(self.norm(g))

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}


def base_hidden(base_model: nn.Module, ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """One forward of the base's decoder (no lm_head) over ids (B, T): the feeding layers' outputs (B, T, len(layers) H)."""
    out = base_model.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    states = out.hidden_states  # embeddings, then each decoder layer's output
    return torch.cat([states[i + 1] for i in layers], dim=-1)


NEG = float("-inf")


def ttt_mask(length: int, step: int, dtype=torch.float32) -> torch.Tensor:
    """(1, 1, T, (step + 1) T) additive mask of unrolled step ``step`` over T positions: query t sees step 0's keys
    at positions <= t (committed) and steps 1..step's keys at t itself (its own draft chain), as a draft at tree
    depth ``step`` sees the committed positions and its ancestors."""
    causal = torch.full((length, length), NEG, dtype=dtype).triu(1)
    diagonal = torch.full((length, length), NEG, dtype=dtype).fill_diagonal_(0.0)
    return torch.cat([causal, *[diagonal] * step], dim=1)[None, None]


def check_drafter_out(folder: str | Path, flag: str = "--out") -> None:
    """Raise ``NotOursError`` unless ``folder`` may receive a drafter: absent, empty, or a drafter folder whose
    files.json lists every file in it (a user's folder is never replaced)."""
    durable.check_folder_ours(folder, kind="eagle", flag=flag)


def save_drafter(drafter: EagleDrafter, folder: str | Path, *, extra: dict[str, str] | None = None, flag: str = "--out") -> Path:
    """Write the drafter folder (and ``extra``: file name -> text) whole or not at all, with its files.json."""
    from safetensors.torch import save_file

    from medusa_trt.runtime.manifest import write_folder_manifest

    folder = Path(folder)
    if not folder.parent.is_dir():
        raise EagleFormatError(f"cannot write the drafter to {folder}: folder {folder.parent} does not exist")
    check_drafter_out(folder, flag)
    with durable.staged_folder(folder) as staged:
        save_file(drafter.state(), str(staged / EAGLE_WEIGHTS))
        (staged / EAGLE_CONFIG).write_text(json.dumps(dataclasses.asdict(drafter.config), indent=1) + "\n", encoding="utf-8")
        for name, text in (extra or {}).items():
            (staged / name).write_text(text, encoding="utf-8")
        write_folder_manifest(staged, "eagle")
        check_drafter_out(folder, flag)  # once more: a file may have appeared while the drafter was written
    return folder


def load_drafter(folder: str | Path, base_model: nn.Module) -> EagleDrafter:
    """A drafter folder written by ``save_drafter``, on ``base_model``; EagleFormatError naming what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = EagleConfig(**json.loads((folder / EAGLE_CONFIG).read_text(encoding="utf-8")))
        weights = load_file(str(folder / EAGLE_WEIGHTS))
    except FileNotFoundError as exc:
        raise EagleFormatError(f"{folder} is not an EAGLE-3-style drafter folder ({Path(exc.filename).name} is missing)") from exc
    except (ValueError, TypeError, SafetensorError) as exc:
        raise EagleFormatError(f"{folder}: {EAGLE_CONFIG} or {EAGLE_WEIGHTS} is unreadable ({exc}): train it again") from exc
    drafter = EagleDrafter(config, base_model)
    try:
        drafter.load_state_dict(weights)
    except RuntimeError as exc:
        raise EagleFormatError(f"{folder}: the weights do not fit {EAGLE_CONFIG} ({str(exc).splitlines()[0]})") from exc
    return drafter.eval()
