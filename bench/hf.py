"""``medusa-bench``'s transformers rows: ``generate()`` on the same base model, plain and with prompt lookup."""

from __future__ import annotations

import time

from medusa_trt.runtime.errors import MedusaError


def hf_model(name: str, threads: int | None):
    """The base model for the transformers rows, or an error saying which extra to install."""
    try:
        import torch

        from medusa_trt.exporter.models import load_base_model
    except ImportError as exc:  # the lean install: ONNX Runtime only
        raise MedusaError(
            f"the transformers rows need torch and transformers ({exc.name} is not installed): "
            "pip install 'medusa-trt[export]', or pass --no-hf"
        ) from exc

    if threads:
        torch.set_num_threads(threads)
    return load_base_model(name)


def hf_generate(base, ids: list[int], max_new_tokens: int, eos: list[int], lookup: int | None, sampling=None) -> tuple[list[int], float]:
    """(new token ids, seconds) of ``generate()`` on prompt ``ids``; ``lookup``: prompt_lookup_num_tokens."""
    import torch

    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if sampling is not None and sampling.temperature > 0:
        torch.manual_seed(sampling.seed)
        extra |= dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
    else:
        extra |= dict(do_sample=False, top_k=None, top_p=None, temperature=None)
    start = time.perf_counter()
    with torch.inference_mode():
        out = base.model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0] if eos else 0, **extra
        )
    return out[0, len(ids) :].tolist(), time.perf_counter() - start
