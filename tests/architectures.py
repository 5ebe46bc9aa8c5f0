"""The architecture fixtures: one row per decoder family, tiny random configs that make each feature count.

Adding an architecture to the suite is one line in ``ARCHITECTURES``. Each row builds a
``transformers`` config (vocabulary 512, hidden 64, 3 layers, 4 query heads over 2 KV heads unless
the family fixes otherwise) with the weights scaled (``INIT``) so that attention is sharp: a
sliding window of ``WINDOW`` tokens or a soft-cap then changes the model's output, and a test that
drops the feature fails. ``HYBRIDS`` are models the exporter must refuse in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WINDOW = 6  # tokens: every prompt and tree in the tests reaches past it
INIT = 0.3  # initializer_range: logits spread enough that a dropped feature changes greedy tokens
VOCAB = 512  # the stories260K tokenizer's vocabulary, so fixtures take its prompts
BIAS_SPREAD = 0.1  # the spread of the noise on every 1-D parameter (norm weights, biases, sinks)

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=INIT,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@dataclass(frozen=True)
class Arch:
    """One family: its ``model_type``, config overrides, and the attention features it exercises."""

    model_type: str
    overrides: dict = field(default_factory=dict)
    features: tuple[str, ...] = ()  # what the fixture makes count (for the docs table and test ids)
    moe: bool = False
    native: bool | None = None  # whether the native step runs it (None: its model type is one of NATIVE)

    @property
    def runs_native(self) -> bool:
        return self.native if self.native is not None else self.model_type in NATIVE

    @property
    def id(self) -> str:
        return self.model_type + ("-" + "-".join(self.features) if self.features else "")

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **(COMMON | self.overrides))


ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

ARCHITECTURES = (
    Arch("llama", {"rope_parameters": ROPE_LLAMA3 | {"original_max_position_embeddings": 64}}, ("rope-scaling",)),
    Arch("llama", {"num_key_value_heads": 1}, ("mqa",)),
    Arch("mistral", {"sliding_window": WINDOW}, ("window",)),
    Arch("qwen2", {"use_sliding_window": False}),
    Arch("qwen3", {"head_dim": 16}, ("qk-norm",)),
    Arch("qwen3_moe", {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}, ("moe",), moe=True),
    Arch("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}, ("moe",), moe=True),
    Arch(
        "qwen2_moe",
        {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2},
        ("moe", "shared-expert"),
        moe=True,
    ),
    Arch("olmoe", {"num_experts": 4, "num_experts_per_tok": 2}, ("moe",), moe=True),
    Arch(
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 8,
            "tie_word_embeddings": True,
        },
        ("window", "softcap", "scaling", "tied"),
    ),
    Arch("gemma", {"head_dim": 16, "tie_word_embeddings": True}, ("gelu-tanh", "scaled-embedding", "tied")),
    Arch(
        "gemma3_text",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        ("window-mix", "qk-norm", "scaling"),
    ),
    Arch("phi3", {"sliding_window": None}, ("fused-qkv",)),
    Arch("olmo2", {}, ("qk-norm",)),
    Arch(
        "granite",
        {"attention_multiplier": 0.5, "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 2.0},
        ("scaling",),
    ),
    Arch("gpt_neox", {"rotary_pct": 0.5}, ("partial-rotary",)),
    Arch(
        "gpt_oss",
        {
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        ("sinks", "window-mix", "moe"),
        moe=True,
    ),
)

# the families the native step runs (runtime/native_weights.py's MODEL_TYPES); it refuses the others' engines by name
NATIVE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "granite", "olmo2", "stablelm", "nemotron")
NATIVE += ("gpt_neox", "helium")  # parallel residual, per-head q/k/v, GELU MLP biases; interleaved rotary ops
NATIVE += ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")  # routed experts (runtime/native_experts.py)

# Hybrids and other models that a KV cache and a tree mask cannot verify: refused at load, one line
HYBRIDS = (
    Arch("jamba", {"attn_layer_period": 2, "attn_layer_offset": 1, "num_experts": 1, "expert_layer_period": 1, "expert_layer_offset": 0}),
    Arch("lfm2", {"layer_types": ["conv", "full_attention", "conv"]}),
)


def save_fixture(arch: Arch, folder, tokenizer, seed: int = 0):
    """A random model of ``arch`` saved as a Hugging Face folder (config.json + safetensors) with ``tokenizer``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(arch.config())
    with torch.no_grad():  # norm weights and biases off their 1 / 0 init (each layer its own), so that each one counts
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter) * BIAS_SPREAD)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
