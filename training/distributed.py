"""Where head training runs: one device per process, and the processes of a ``torchrun`` launch.

``medusa-train`` is the same command under ``torchrun --nproc-per-node N`` (and ``--nnodes M``):
torchrun sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, and ``Cluster.start`` joins the process
group (gloo on the CPU, NCCL on GPUs). What each rank does (``training/data.py``,
``training/train.py``):

* data: prompts, generation and hidden-state shards are split by rank (item i to rank i mod N),
  each rank writing files of its own; every rank then reads all of them;
* training: every rank holds the heads (DDP) and takes its share of each global batch, so
  ``--batch-size`` stays the positions per optimizer step and the order of positions is the same
  for any world size; rank 0 alone writes checkpoints and the heads folder.

Devices: ``--device cpu``, ``cuda`` or ``cuda:N``; default CUDA where torch sees a GPU, else the CPU.
Under torchrun with CUDA each process takes GPU ``LOCAL_RANK`` (``cuda:N`` is refused there).
The frozen base runs in bfloat16 on GPUs that have it (float16 on older ones), float32 on the CPU.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch

from medusa_trt.runtime.errors import MedusaError
from medusa_trt.training.config import TrainError

log = logging.getLogger(__name__)


def resolve_device(text: str | None, *, flag: str = "--device") -> torch.device:
    """The device of ``--device`` (None: CUDA where available, else the CPU), refused in one line
    when this machine has no such device."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, index = text.partition(":")
    if text == "cpu":
        return torch.device("cpu")
    if kind != "cuda" or (index and not index.isdigit()):
        raise TrainError(f"{flag} {text}: pass cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise TrainError(f"{flag} {text}: torch sees no CUDA GPU on this machine ({torch.__version__}); pass {flag} cpu")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise TrainError(f"{flag} {text}: this machine has {count} CUDA GPU(s), cuda:0..cuda:{count - 1}")
    return torch.device(text if index else "cuda:0")


def base_dtype(device: torch.device) -> torch.dtype:
    """The frozen base model's dtype on ``device``: float32 on the CPU, bfloat16 on GPUs that have
    it, else float16."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


@dataclass(frozen=True)
class Cluster:
    """This process's place in the run: rank of world, and its device."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes checkpoints, the heads folder and the work folder's fingerprint."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @classmethod
    def start(cls, device: str | None = None) -> Cluster:
        """This process's cluster: one process, or a rank of a ``torchrun`` launch (the process
        group joined here, gloo on the CPU, NCCL on GPUs)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(device=resolve_device(device))
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        chosen = resolve_device(device)
        if chosen.type == "cuda":
            if device is not None and ":" in device:
                raise TrainError(f"--device {device}: under torchrun each process takes GPU LOCAL_RANK; pass --device cuda")
            if local_rank >= torch.cuda.device_count():
                raise TrainError(
                    f"torchrun started {local_rank + 1}+ processes on this node but it has {torch.cuda.device_count()} CUDA GPU(s): "
                    "pass --nproc-per-node at most that many"
                )
            chosen = torch.device("cuda", local_rank)
            torch.cuda.set_device(chosen)
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if chosen.type == "cuda" else "gloo"
            dist.init_process_group(backend, device_id=chosen if chosen.type == "cuda" else None)
        log.info("rank %d of %d on %s", rank, world, chosen)
        return cls(rank=rank, world=world, local_rank=local_rank, device=chosen)

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the ranks (in place, and returned)."""
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(value)
        return value

    def all_ok(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank (a rank that failed a check stops them all together)."""
        if not self.distributed:
            return ok
        flag = torch.tensor([0 if ok else 1], device=self.device if self.device.type == "cuda" else "cpu")
        return int(self.all_sum(flag).item()) == 0  # .item(): the decision is taken on the host

    def on_main(self, work):
        """``work()`` on rank 0 alone, the others waiting; a user error it raises is raised on every
        rank (each prints the same one line, and none is left waiting for the others)."""
        if not self.distributed:
            return work()
        import torch.distributed as dist

        result, error = None, None
        if self.main:
            try:
                result = work()
            except MedusaError as exc:
                error = exc
        box = [None if error is None else str(error)]
        dist.broadcast_object_list(box, src=0)
        if error is not None:
            raise error
        if box[0] is not None:
            raise TrainError(box[0])
        return result

    def stop(self, *, together: bool = False) -> None:
        """Leave the process group (the end of a run). ``together``: every rank reached the end, so they
        meet at a barrier first, and no rank tears its connections down while another still uses them (gloo
        then aborts the slower rank's process). After an error on one rank there is no barrier: the others
        would wait for it."""
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                if together:
                    dist.barrier()
                dist.destroy_process_group()

    def leave(self, code: int) -> NoReturn:
        """End this torchrun rank now with ``code``, its output flushed, skipping the interpreter's finalization. There
        gloo's threads, outliving ``destroy_process_group``, now and then abort the process after its last line ("terminate
        called without an active exception": 1 run in about 10 on two busy cores here), and torchrun then reports the run
        as failed although every file was written. medusa-train closes (and makes durable) every file it writes first."""
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


SINGLE = Cluster()  # one process on the CPU: the library's default, and what the tests call


def shard_base(base, cluster: Cluster) -> None:
    """Shard the frozen base's decoder layers over the ranks with FSDP2 (``fully_shard``); the
    embeddings, final norm and lm_head stay whole on each device (the heads read them). Every rank
    must then run the same forward passes together (``training/data.py`` pads with dummy ones)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(cluster.device.type, (cluster.world,))
    layers = getattr(base.model.get_decoder(), "layers", None)
    if layers is None:
        raise TrainError(f"--fsdp: {base.name}'s decoder has no .layers to shard; drop --fsdp")
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    from torch.distributed.tensor import DTensor

    for module in base.model.modules():  # what is not sharded moves whole to the device
        for _, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                param.data = param.data.to(cluster.device)
        for name, buffer in list(module.named_buffers(recurse=False)):
            module._buffers[name] = buffer.to(cluster.device)


def base_fits(model_bytes: int, device: torch.device) -> bool:
    """Whether a base of ``model_bytes`` fits on ``device`` with room for activations (the CPU: always)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return model_bytes < 0.8 * free


def load_base(model: str, config, cluster):
    """The frozen base on this rank's device (bf16 / fp16 on a GPU, fp32 on the CPU), or sharded
    over the ranks (``--fsdp``, or a GPU it does not fit)."""
    from medusa_trt.exporter.models import load_base_model

    dtype = base_dtype(cluster.device)
    if config.fsdp and not cluster.distributed:
        raise TrainError(
            "--fsdp shards the base over the processes of a torchrun launch: run under torchrun --nproc-per-node N, or drop it"
        )
    if not cluster.distributed or (cluster.device.type == "cpu" and not config.fsdp):
        return load_base_model(model, dtype=dtype, device=str(cluster.device))
    base = load_base_model(model, dtype=dtype, device="cpu")
    size = sum(p.numel() * p.element_size() for p in base.model.parameters())
    if config.fsdp or not base_fits(size, cluster.device):
        shard_base(base, cluster)
    else:
        base.model.to(cluster.device)
    return base
