"""Named model shapes: real architectures (random weights, for benchmarks and shape checks) and tiny ones."""
from __future__ import annotations

from glint.model.config import ModelConfig, RopeConfig

_LLAMA31_ROPE = RopeConfig(500000.0, "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position=8192)


def _llama3_8b() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, intermediate_size=14336, layer_rope=(_LLAMA31_ROPE,) * 32,
                       norm_eps=1e-5, max_position_embeddings=131072, bos_token_id=128000,
                       eos_token_ids=(128001, 128008, 128009))


def _qwen3_8b() -> ModelConfig:
    return ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32,
                       num_kv_heads=8, head_dim=128, intermediate_size=12288, layer_rope=(RopeConfig(1e6),) * 36,
                       norm_eps=1e-6, qk_norm="rms", max_position_embeddings=40960, eos_token_ids=(151645,))


def _gemma3_4b() -> ModelConfig:
    n, local = 34, [(i + 1) % 6 != 0 for i in range(34)]
    return ModelConfig(
        model_type="gemma3_text", vocab_size=262208, hidden_size=2560, num_layers=n, num_heads=8, num_kv_heads=4,
        head_dim=256, intermediate_size=10240, layer_windows=tuple(1024 if loc else 0 for loc in local),
        layer_rope=tuple(RopeConfig(1e4) if loc else RopeConfig(1e6, "linear", factor=8.0) for loc in local),
        norm_eps=1e-6, activation="gelu_tanh", tie_embeddings=True, qk_norm="rms", sandwich_norm=True,
        query_scale=256 ** -0.5, embed_scale=True, norm_delta=True, max_position_embeddings=131072,
        bos_token_id=2, eos_token_ids=(1, 106))


def _glimmer_30b() -> ModelConfig:
    """Muse Glimmer: 3 of 4 layers slide (W 2048, RoPE 5e5); every 4th is global with no RoPE."""
    n, local = 52, [i % 4 != 3 for i in range(52)]
    return ModelConfig(
        model_type="glimmer", vocab_size=202048, hidden_size=6656, num_layers=n, num_heads=32, num_kv_heads=2,
        head_dim=128, intermediate_size=19968, layer_windows=tuple(2048 if loc else 0 for loc in local),
        layer_rope=tuple(RopeConfig(5e5) if loc else None for loc in local), norm_eps=1e-5, qk_norm="rms_scaleless",
        sandwich_norm=True, final_softcap=20.0, embed_norm=True, attn_output_gate=True, norm_delta=True,
        max_position_embeddings=131072)


def _tiny() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, intermediate_size=128, layer_windows=(0, 16), max_position_embeddings=1024,
                       bos_token_id=1, eos_token_ids=(2,))


def _demo() -> ModelConfig:
    """The built-in default: small enough for a CPU, with global and sliding-window layers."""
    return ModelConfig(model_type="llama", vocab_size=512, hidden_size=128, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=32, intermediate_size=256, layer_windows=(0, 64, 0, 64),
                       max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,))


PRESETS = {"llama3-8b": _llama3_8b, "qwen3-8b": _qwen3_8b, "gemma3-4b": _gemma3_4b,
           "muse-glimmer-30b": _glimmer_30b, "tiny": _tiny, "demo": _demo}

# Published parameter counts of the real checkpoints (text model only), to check the shapes against.
KNOWN_PARAMS = {"llama3-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360, "gemma3-4b": 3_880_263_168}


def preset(name: str, dtype: str = "bfloat16") -> ModelConfig:
    """A ModelConfig by preset name (ValueError listing the names for an unknown one)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (known: {sorted(PRESETS)})")
    return PRESETS[name]().replace(dtype=dtype)
