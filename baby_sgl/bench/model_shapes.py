"""The real models whose shapes `bench offline --model-shape` builds random-weight checkpoints of
(checkpoints.py): each architecture as its config.json gives it. Kept apart from the builder, which
needs torch, so the command line can list them at once."""

from __future__ import annotations

from dataclasses import dataclass


# Qwen2.5's special tokens (ids 151643...), as its tokenizer lists them.
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


@dataclass(frozen=True)
class ModelShape:
    """A model's architecture as its config.json gives it. tokenizer: "smollm2" takes the default
    model's (SmolLM2's 49152 tokens, from its GGUF file); a number n builds a byte-level BPE of n
    regular tokens plus `specials` (byte_bpe.py)."""
    name: str
    model_type: str  # "llama" or "qwen2"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    tokenizer: str | int
    specials: tuple[str, ...] = ()
    bos: str = ""
    eos: str = ""
    init_std: float = 0.02  # keeps activations in range through every layer: no NaN in bfloat16

    def hf_config(self, bos_id: int, eos_id: int) -> dict:
        """config.json in the keys the real checkpoints use, which transformers 4 and 5 and vLLM read."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        cfg = {"architectures": [arch], "model_type": self.model_type, "hidden_size": self.hidden_size,
               "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
               "num_key_value_heads": self.num_key_value_heads, "intermediate_size": self.intermediate_size,
               "vocab_size": self.vocab_size, "rope_theta": self.rope_theta, "rope_scaling": None,
               "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
               "hidden_act": "silu", "tie_word_embeddings": True, "bos_token_id": bos_id, "eos_token_id": eos_id,
               "initializer_range": self.init_std, "attention_dropout": 0.0, "use_cache": True,
               "torch_dtype": "bfloat16"}
        if self.model_type == "llama":
            return cfg | {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
        return cfg | {"use_sliding_window": False, "sliding_window": self.max_position_embeddings,
                      "max_window_layers": self.num_hidden_layers}


# The figures are those of the models' config.json on the Hugging Face hub
# (HuggingFaceTB/SmolLM2-1.7B-Instruct, Qwen/Qwen2.5-1.5B-Instruct).
SHAPES = {
    "smollm2-1.7b": ModelShape("smollm2-1.7b", "llama", hidden_size=2048, num_hidden_layers=24,
                               num_attention_heads=32, num_key_value_heads=32, intermediate_size=8192,
                               vocab_size=49152, rope_theta=130000.0, max_position_embeddings=8192,
                               rms_norm_eps=1e-5, tokenizer="smollm2"),
    # Qwen2.5: 151643 regular tokens and 22 specials; the embedding has 151936 rows.
    "qwen2.5-1.5b": ModelShape("qwen2.5-1.5b", "qwen2", hidden_size=1536, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                               vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=32768,
                               rms_norm_eps=1e-6, tokenizer=151643, specials=tuple(QWEN2_SPECIALS),
                               bos="<|endoftext|>", eos="<|im_end|>"),
}
