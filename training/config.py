"""The head-training stage's configuration (``TrainConfig``, saved beside the heads it produced) and
its error. Every other module of ``training/`` imports these; they import nothing of ``training/``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from medusa_trt.runtime.errors import MedusaError

GENERATE_CONTEXT = 1024  # prompt + continuation tokens of the self-distillation runtime (at most the model's positions)


class TrainError(MedusaError):
    """Training cannot run as configured."""


# least value of each whole-number setting
_AT_LEAST = {
    "num_heads": 1,
    "num_layers": 1,
    "num_prompts": 1,
    "follow_ups": 0,
    "new_tokens": 1,
    "generate_batch": 1,
    "epochs": 1,
    "batch_size": 1,
    "warmup_steps": 0,
    "seed": 0,
    "checkpoint_every": 1,
    "teacher_concurrency": 1,
}
_MAX_SEED = 2**32 - 1  # the batch order's generator is seeded with seed * 1000 + epoch
# the command-line flag of a TrainConfig field, for messages
_FLAGS = {
    "num_heads": "--heads",
    "num_layers": "--layers",
    "warmup_steps": "warmup steps",
    "generate_batch": "generate batch",
    "weight_decay": "weight decay",
    "holdout": "holdout",
    "chat_template": "chat template",
    "teacher_concurrency": "--teacher-concurrency",
}


def flag(field: str) -> str:
    """The command-line flag (or words) naming TrainConfig field ``field`` in a message."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


@dataclass(frozen=True)
class TrainConfig:
    out: str  # heads folder to write (ours: heads.json + heads.safetensors)
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    shared_lm_head: bool = False  # project with the frozen base lm_head (a few MB of heads) instead of own projections
    head_input: str = "hidden"  # "hidden+next": next-token-aware heads (they also read the next token's embedding)
    head_layer: int | None = None  # decoder layer feeding the heads; None: final hidden state
    decay: float = 0.8  # weight of head k is decay^k: far heads matter less and are harder
    data: str | None = None  # prompts file (.jsonl with turns[0]/prompt/text, or .txt, one per line); None: built-in prompts
    teacher_forced: bool = False  # data is corpus text whose own tokens are the labels (no generation)
    num_prompts: int = 400  # built-in prompts used (or the first N of --data)
    follow_ups: int = 0  # second turns on the model's own first answers (the first N), generated after the first turns
    new_tokens: int = 128  # continuation length per prompt
    chat_template: bool = True  # wrap prompts in the model's chat template when it has one
    generate_batch: int = 16  # rows generating at once
    generate_engine: str | None = None  # an exported .onnx engine of the same base model: faster self-distillation on CPU
    epochs: int = 3
    batch_size: int = 256  # positions per optimizer step
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    holdout: float = 0.05  # fraction of sequences kept for the accuracy report
    seed: int = 0
    checkpoint_every: int = 50  # optimizer steps
    work: str | None = None  # work folder (default <out>.work); one folder can feed several trainings of the same data
    bf16: bool = False  # heads' matmuls in bfloat16 autocast on the CPU (about 2x faster with AVX512-BF16/AMX); GPUs always autocast
    device: str | None = None  # cpu, cuda or cuda:N; None: CUDA where torch sees a GPU, else the CPU (training/distributed.py)
    fsdp: bool = False  # shard the frozen base's decoder layers over the ranks (FSDP2); also chosen when it does not fit one GPU
    teacher: str | None = None  # an OpenAI-compatible base URL that writes the continuations instead (training/teacher.py)
    teacher_concurrency: int = 8  # requests in flight to the teacher, per rank

    def __post_init__(self):
        for name, least in _AT_LEAST.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise TrainError(f"{flag(name)} {value} must be a whole number >= {least}")
        if self.seed > _MAX_SEED:
            raise TrainError(f"--seed {self.seed} must be at most {_MAX_SEED}")
        layer = self.head_layer
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
            raise TrainError(f"--head-layer {self.head_layer} must be a decoder layer index >= 0 (leave it out for the final hidden state)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise TrainError(f"--lr {self.lr} must be a positive number, e.g. 1e-3")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise TrainError(f"weight decay {self.weight_decay} must be a number >= 0")
        if not 0.0 < self.decay <= 1.0:
            raise TrainError(f"--decay {self.decay} must be in (0, 1]")
        if not 0.0 <= self.holdout < 1.0:
            raise TrainError(f"holdout {self.holdout} must be in [0, 1): the fraction of sequences kept for the accuracy report")
        if self.teacher_forced and self.data is None:
            raise TrainError("--teacher-forced needs --data: a corpus whose own tokens are the labels")
        from medusa_trt.exporter.heads import HEAD_INPUTS

        if self.head_input not in HEAD_INPUTS:
            raise TrainError(f"--head-input {self.head_input} is not one of {', '.join(HEAD_INPUTS)}")
        if self.follow_ups > self.num_prompts:
            raise TrainError(
                f"--follow-ups {self.follow_ups} exceeds --num-prompts {self.num_prompts}: each follow-up "
                "continues one first-turn conversation; pass at most that many"
            )
        if self.teacher is not None and self.generate_engine is not None:
            raise TrainError("--teacher and --generate-engine both write the continuations: pass one of them")
        if self.teacher is not None and self.teacher_forced:
            raise TrainError("--teacher-forced takes the corpus's own tokens: drop --teacher")
        if self.follow_ups and self.teacher_forced:
            raise TrainError("--follow-ups needs generated answers: drop it with --teacher-forced")

    @property
    def workdir(self) -> Path:
        return Path(self.work) if self.work is not None else Path(str(self.out) + ".work")
