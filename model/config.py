"""Model configuration: one frozen dataclass for every supported family, mapped from HF config.json."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass
from typing import Any

ROPE_KINDS = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_tanh")
QK_NORMS = ("none", "rms", "rms_scaleless")
QUANT_FORMATS = ("none", "int8", "int4", "fp8")  # weight formats of the linears (model/quant.py)
DTYPES = ("bfloat16", "float32", "float16")
QUANTIZE_HELP = ("int8: weight-only, per output channel; int4: weight-only, per group of input rows and output "
                 "channel; fp8: float8_e4m3fn weights per output channel and activations per token (W8A8)")
# How the formats lay out their arrays (model/quant.py): 1 (a glint.json without the field): int8 and int4 stored
# [in, out]; 2: [out, in], int4's scales [out, groups]; 3: int4's scales [groups, out]. This glint reads layout 3
# and the older ones wherever they stored the same arrays.
QUANT_LAYOUT = 3
_LAYOUT_CHANGES = {1: "int8 / int4 [in, out], before 2026-12-03", 2: "int4 scales [out, groups]"}


def _layout_changed(quantize: str, quantize_head: bool, tie_embeddings: bool, layout: int) -> bool:
    """Whether `layout` stored these arrays otherwise than QUANT_LAYOUT: layout 1 held int8 / int4 linears and an
    untied int8 head [in, out] (a tied head's table and fp8 were [out, in] already), layouts 1 and 2 int4's scales
    [out, groups]; a later layout, whatever another glint wrote, any quantized arrays."""
    if layout > QUANT_LAYOUT:
        return quantize != "none" or quantize_head
    return (quantize == "int4" and layout < 3) or (
        layout < 2 and (quantize == "int8" or (quantize_head and not tie_embeddings)))


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer; `kind` is the HF rope_type."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope_type {self.kind!r} is not supported (supported: {ROPE_KINDS})")
        if not self.theta > 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.kind != "default" and not self.factor > 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")

    @classmethod
    def from_hf(cls, params: dict[str, Any]) -> RopeConfig:
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ROPE_KINDS:
            raise ValueError(f"rope_type {kind!r} is not supported (supported: {ROPE_KINDS})")
        known = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings", "partial_rotary_factor"}
        if kind == "default":
            known -= {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"rope parameters {unknown} are not supported for rope_type {kind!r}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']} is not supported (only 1.0)")
        return cls(theta=float(params["rope_theta"]), kind=kind, factor=float(params.get("factor", 1.0)),
                   low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                   original_max_position=int(params.get("original_max_position_embeddings", 8192)))


def linears_label(model) -> str:
    """A model's (ModelConfig or an artifact's ModelInfo) linears in words ("int4 weight-only, group 128", ...)."""
    label = {"none": model.dtype, "int8": "int8 weight-only", "int4": f"int4 weight-only, group {model.quant_group}",
             "fp8": "fp8 weights and activations"}[model.quantize]
    return label + (", head int8" if model.quantize_head else "")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and layout of a decoder-only transformer.

    Per-layer tuples: `layer_windows[i]` is the sliding window of layer i (0 = global attention),
    `layer_rope[i]` its rotary embedding (None = no RoPE).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_windows: tuple[int, ...] = ()
    layer_rope: tuple[RopeConfig | None, ...] = ()
    norm_eps: float = 1e-5
    activation: str = "silu"
    tie_embeddings: bool = False
    qk_norm: str = "none"
    sandwich_norm: bool = False  # extra norms on the attention and MLP outputs (Gemma 2/3, Glimmer)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    query_scale: float = 0.0  # 0: head_dim ** -0.5
    embed_scale: bool = False  # multiply token embeddings by sqrt(hidden_size) (Gemma)
    embed_norm: bool = False  # RMSNorm on token embeddings (Glimmer)
    attn_output_gate: bool = False  # sigmoid(x W_g) * attention output (Glimmer)
    norm_delta: bool = False  # checkpoint stores norm weights as w - 1 (Gemma (1+w), Glimmer)
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    quantize: str = "none"  # the linears' weight format (model/quant.py); embedding, head and norms keep dtype
    quant_group: int = 128  # int4: input rows per scale
    quantize_head: bool = False  # the LM head (the embedding table too when tied) as int8 per vocab entry
    quant_layout: int = QUANT_LAYOUT  # the stored layout of the quantized arrays (above)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        if not self.layer_rope:
            object.__setattr__(self, "layer_rope", (RopeConfig(10000.0),) * self.num_layers)
        object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))
        object.__setattr__(self, "layer_rope", tuple(self.layer_rope))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        for name in ("layer_windows", "layer_rope"):
            if len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {self.num_layers} layers")
        if any(w < 0 for w in self.layer_windows):
            raise ValueError(f"layer_windows must be >= 0, got {self.layer_windows}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported (supported: {ACTIVATIONS})")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {self.qk_norm!r} is not supported (supported: {QK_NORMS})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported (supported: {DTYPES})")
        if self.quantize not in QUANT_FORMATS:
            raise ValueError(f"quantize {self.quantize!r} is not supported (supported: {QUANT_FORMATS})")
        if not isinstance(self.quant_group, int) or self.quant_group < 1:
            raise ValueError(f"quant_group must be a positive int, got {self.quant_group!r}")
        if self.quantize == "int4" and self.quant_group % 2:
            raise ValueError(f"quant_group {self.quant_group} must be even for int4 (two input rows per byte)")
        if _layout_changed(self.quantize, self.quantize_head, self.tie_embeddings, self.quant_layout):
            was = _LAYOUT_CHANGES.get(self.quant_layout, "written by another glint")
            raise ValueError(f"quantize={self.quantize!r}, quantize_head={self.quantize_head} stored in layout "
                             f"{self.quant_layout} ({was}); this glint reads "
                             f"layout {QUANT_LAYOUT}: convert or export the HF checkpoint again")
        for name in ("attn_softcap", "final_softcap", "query_scale", "norm_eps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def linears_label(self) -> str:
        return linears_label(self)

    @property
    def scale(self) -> float:
        return self.query_scale or self.head_dim ** -0.5

    @property
    def num_params(self) -> int:
        """Parameter count from the shapes alone (checked against the built model in tests)."""
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += d * hd * self.num_heads * self.attn_output_gate
        attn += 2 * hd * (self.qk_norm == "rms")
        mlp = 3 * d * self.intermediate_size
        norms = d * (4 if self.sandwich_norm else 2)
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + embed + d * (1 + self.embed_norm)

    def replace(self, **changes) -> ModelConfig:
        """dataclasses.replace that also shortens per-layer tuples when num_layers shrinks."""
        n = changes.get("num_layers", self.num_layers)
        for name in ("layer_windows", "layer_rope"):
            if name not in changes and n != self.num_layers:
                changes[name] = getattr(self, name)[:n]
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        if "quant_layout" not in d:  # written before the field existed: layout 1 where it differs
            changed = _layout_changed(d.get("quantize", "none"), d.get("quantize_head", False),
                                      d.get("tie_embeddings", False), 1)
            d["quant_layout"] = 1 if changed else QUANT_LAYOUT
        d["layer_rope"] = tuple(None if r is None else RopeConfig(**r) for r in d["layer_rope"])
        return cls(**d)

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | pathlib.Path, dtype: str | None = None) -> ModelConfig:
        """Map a Hugging Face config.json (dict, file or folder) onto a ModelConfig.

        `dtype` defaults to the checkpoint's own (`torch_dtype` / `dtype`; bfloat16 where it names none).
        EOS ids are config.json's (a multimodal wrapper's top-level ones too) and, from a file or folder,
        generation_config.json's beside it (instruct checkpoints list their end-of-turn ids only there).
        Raises ValueError, naming the file, for unreadable or incomplete configs, an unknown model_type or a
        field value we do not implement.
        """
        source, extra_eos = "config", ()
        if not isinstance(config, dict):
            path = pathlib.Path(config)
            file = path / "config.json" if path.is_dir() else path
            source, config = str(file), read_json_object(file)
            generation = file.parent / "generation_config.json"
            if generation.is_file():
                extra_eos = _token_ids(read_json_object(generation).get("eos_token_id"), generation)
        try:
            return _from_hf(config, dtype, extra_eos)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None


def read_json_object(path: pathlib.Path) -> dict[str, Any]:
    """A JSON file that must hold an object; ValueError naming the file otherwise."""
    try:
        value = json.loads(pathlib.Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds {type(value).__name__ if value is not None else 'null'}, not a JSON object")
    return value


def _token_ids(value, where) -> tuple[int, ...]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{where}: eos_token_id {value!r} is not a token id or a list of them")
    return tuple(ids)


def _layer_kinds(c: dict[str, Any], family: str) -> list[str]:
    n = c["num_hidden_layers"]
    if c.get("layer_types"):
        kinds = list(c["layer_types"])
        if len(kinds) != n:
            raise ValueError(f"layer_types has {len(kinds)} entries for num_hidden_layers {n}")
        bad = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"layer_types {bad} are not supported")
        return kinds
    if family == "gemma2":  # before layer_types: even layers slide
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if family == "gemma3_text":
        pattern = c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6))
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if family == "mistral" and c.get("sliding_window"):
        return ["sliding_attention"] * n
    if family == "qwen3" and c.get("use_sliding_window"):
        raise ValueError("qwen3 use_sliding_window=True is not supported")
    return ["full_attention"] * n


def _rope_for(c: dict[str, Any], kind: str) -> RopeConfig:
    params = c.get("rope_parameters")
    if params is None:  # transformers < 5: rope_theta + rope_scaling
        theta = c.get("rope_theta", 10000.0)
        if kind == "sliding_attention" and "rope_local_base_freq" in c:
            return RopeConfig(float(c["rope_local_base_freq"]))
        scaling = c.get("rope_scaling") or {}
        return RopeConfig.from_hf({"rope_theta": theta, **scaling})
    if kind in params and isinstance(params[kind], dict):
        return RopeConfig.from_hf(params[kind])
    if "full_attention" in params or "sliding_attention" in params:
        raise ValueError(f"rope_parameters has no entry for layer type {kind!r}")
    return RopeConfig.from_hf(params)


_FAMILIES = ("llama", "mistral", "qwen3", "gemma2", "gemma3_text")
_UNSUPPORTED_FLAGS = {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
                      "use_bidirectional_attention": False}


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def _from_hf(c: dict[str, Any], dtype: str | None, extra_eos: tuple[int, ...] = ()) -> ModelConfig:
    family = c.get("model_type")
    wrapper_eos = ()
    if family == "gemma3":  # multimodal wrapper: the text model is in text_config
        wrapper_eos = _token_ids(c.get("eos_token_id"), "eos_token_id")
        outer_dtype = {k: c[k] for k in ("torch_dtype", "dtype") if k in c}
        c, family = {**outer_dtype, **c.get("text_config", {}), "model_type": "gemma3_text"}, "gemma3_text"
    if family not in _FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported (supported: {_FAMILIES})")
    missing = [k for k in _REQUIRED if k not in c]
    if missing:
        raise ValueError(f"{family} config lacks {missing}")
    if dtype is None:
        stored = c.get("torch_dtype") or c.get("dtype")
        dtype = stored if stored in DTYPES else "bfloat16"
    for key, ok in _UNSUPPORTED_FLAGS.items():
        if c.get(key) not in (None, ok):
            raise ValueError(f"{key}={c[key]!r} is not supported (only {ok!r})")
    act = c.get("hidden_activation") or c.get("hidden_act", "silu")
    acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if act not in acts:
        raise ValueError(f"activation {act!r} is not supported (supported: {sorted(acts)})")
    kinds = _layer_kinds(c, family)
    window = c.get("sliding_window") or 0
    if "sliding_attention" in kinds and not window:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    gemma = family.startswith("gemma")
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    eos = tuple(dict.fromkeys(_token_ids(c.get("eos_token_id"), "eos_token_id") + wrapper_eos + extra_eos))
    scalar = c.get("query_pre_attn_scalar") if gemma else None
    return ModelConfig(
        model_type=family,
        vocab_size=c["vocab_size"],
        hidden_size=hidden,
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=c["intermediate_size"],
        layer_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds),
        layer_rope=tuple(_rope_for(c, k) for k in kinds),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        activation=acts[act],
        tie_embeddings=bool(c.get("tie_word_embeddings", gemma)),
        qk_norm="rms" if family in ("qwen3", "gemma3_text") else "none",
        sandwich_norm=gemma,
        attn_softcap=float(c.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(c.get("final_logit_softcapping") or 0.0),
        query_scale=float(scalar) ** -0.5 if scalar else 0.0,
        embed_scale=gemma,
        norm_delta=gemma,
        max_position_embeddings=int(c.get("max_position_embeddings", 8192)),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=eos,
        dtype=dtype,
    )

