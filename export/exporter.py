"""`glint export`: an engine's programs per step width, its weights and metadata, as one self-describing folder.

`glint.runtime.artifact` documents the layout and loads it (`Engine.from_export`) without the model code.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import pathlib
import re
import shutil

import jax
import jaxlib
import orbax.checkpoint as ocp
from jax.experimental.pallas import triton as pallas_triton
from rich.progress import Progress

from glint.export.checkpoint import SIDE_FILES
from glint.runtime import executables
from glint.runtime.artifact import FORMAT, FORMAT_VERSION, METADATA, PARAMS_DIR, PROGRAM_ABI, platform_name
from glint.runtime.params import MAX_LOGPROBS
from glint.runtime.programs import COPY_ROWS, TABLE_ROWS
from glint.runtime.sampling import BIAS_WIDTH

# The Pallas Triton custom call is not among jax.export's stable targets (Mosaic GPU's is): we export it
# knowingly, and the artifact pins the jax/jaxlib versions that load it.
DISABLED_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(pallas_triton.CUSTOM_CALL_TARGET_NAME)]
_CUSTOM_CALL = re.compile(r'stablehlo\.custom_call @([\w$.]+)|call_target_name = "([^"]+)"')


# What each program takes and returns (R = selected_logit_rows, V = vocab_size, W = the width, S = min(W,
# max_seqs), G = the number of layer groups, P_g = cache.groups[g].pages_per_seq, C_W = min(W, W // page_size
# + 2 S) = programs.step_changes: the page-table entries a step carries, more go first through `tables`), for
# users who drive an artifact without glint. Every forward returns the selected rows' logits beside the tokens:
# a caller sampling on the host reads those.
SIGNATURES = {
    "forward_W": {"inputs": ["params {dotted name: array}",
                             ("kv ((k per layer), (v per layer)), and with an fp8 cache ((k_scale per layer), "
                              "(v_scale per layer)) after them"),
                             ("tables: per group g the page table i32[max_seqs, P_g] (row s: sequence s's pages; "
                              "kv_init gives them zeroed, each forward returns them updated)"),
                             ("host i32[N]: these, flattened, in this order, each starting at a multiple of 64 "
                              "elements (256 bytes; zeros between; f32 and u32 as their bits): tokens i32[W], "
                              "token_src i32[W] (>= 0: take prev_tokens[token_src]), positions i32[W], "
                              "slots i32[G, W], seq_info i32[S, 4] (q_start, q_len, sequence, kv_end), "
                              "table_changes i32[C_W, 3] (sequence, page index, page; each (sequence, index) once; "
                              "pads name sequence max_seqs) for each "
                              "group g, rows i32[R], draft_rows "
                              "i32[R] (zeros), temperature f32[R], top_k i32[R], top_p f32[R], min_p f32[R], "
                              "seed u32[R], position i32[R]"),
                             "prev_tokens i32[R]"],
                  "outputs": ["tokens i32[R] (argmax, or drawn with min-p, without top-k/top-p)", "logits f32[R, V]",
                              "kv", "tables (the changes applied)"],
                  "donated": ["kv", "tables"]},
    "sample": {"inputs": ["logits f32[R, V]", "sampler"], "outputs": ["tokens i32[R] (min-p/top-k/top-p applied)"]},
    "penalize_H": {"inputs": ["logits f32[R, V]",
                              ("history i32[R, H] (prompt, then completion; < 0: row -(h + 1) of prev_tokens; "
                               "2^31 - 1 pads; H: the first of 256, 1024, ... and the capacity that holds the "
                               "longest)"),
                              "prompt_len i32[R]", "presence f32[R]", "frequency f32[R]", "repetition f32[R]",
                              (f"bias_ids i32[R, {BIAS_WIDTH}] (each row's biased, banned and allowed tokens, each "
                               "once; 2^31 - 1 pads)"),
                              f"bias f32[R, {BIAS_WIDTH}] (added to those logits; -inf bans)",
                              f"allowed bool[R, {BIAS_WIDTH}] (bias_ids a restricted row may draw)",
                              "restricted bool[R] (only its allowed tokens may be drawn)",
                              "prev_tokens i32[R]", "sampler"],
                   "outputs": ["logits f32[R, V] (restriction, biases, then penalties applied)",
                               "tokens i32[R] (drawn from them with min-p, without top-k/top-p)"]},
    "sample_argmax": {"inputs": ["logits f32[R, V]"], "outputs": ["tokens i32[R]"]},
    "logprobs": {"inputs": ["logits f32[R, V]", "tokens i32[R]"],
                 "outputs": ["chosen f32[R]", f"top f32[R, {MAX_LOGPROBS}]", f"top_ids i32[R, {MAX_LOGPROBS}]"]},
    "copy": {"inputs": ["kv", f"per group (src, dst) page pairs i32[{COPY_ROWS}, 2] ((0, 0) pads)"], "outputs": ["kv"],
             "donated": ["kv"]},
    "tables": {"inputs": ["tables", (f"per group (sequence, page index, page) i32[{TABLE_ROWS}, 3] (pads: "
                                     "sequence max_seqs)")],
               "outputs": ["tables"], "donated": ["tables"]},
    "kv_init": {"inputs": [], "outputs": ["kv, zeroed", "tables, zeroed"]},
}


def check_output_folder(out: pathlib.Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty folder; remove it or choose another")


def custom_calls(exported: jax.export.Exported) -> list[str]:
    """The custom-call targets (the kernels) inside an exported program."""
    text = exported.mlir_module()
    return sorted({a or b for a, b in _CUSTOM_CALL.findall(text)})


def export_engine(checkpoint: str, out, *, dtype: str | None = None, compiled: bool | None = None,
                  show_progress: bool = True, **engine_config) -> dict:
    """Export every program of an engine over `checkpoint` (HF folder, orbax folder or preset) into `out`.

    `compiled` (default: on a GPU) also stores the executables compiled for this GPU and jaxlib.
    Keyword arguments are EngineConfig fields; the pool size (`num_pages`) is fixed at export.
    Returns the metadata written to `out/metadata.json`.
    """
    from glint.runtime.engine import Engine

    out = pathlib.Path(out)
    check_output_folder(out)
    engine = Engine.from_pretrained(checkpoint, dtype=dtype, **engine_config)
    on_gpu = jax.default_backend() == "gpu"
    compiled = on_gpu if compiled is None else compiled
    if compiled and not on_gpu:  # XLA:CPU executables do not survive serialization (symbols go missing)
        raise ValueError(f"compiled executables are stored for GPUs only; this process runs on {platform_name()}")
    (out / "programs").mkdir(parents=True, exist_ok=True)
    if compiled:
        (out / "compiled").mkdir(exist_ok=True)
    programs = {}
    names = engine.program_names() + ["sample_argmax", "kv_init"]
    with Progress(disable=not show_progress, transient=True) as bar:
        task = bar.add_task("exporting", total=len(names))
        if compiled:
            engine.programs.compile_all(names)
        for name in names:
            program = engine.programs.programs[name]
            exported = jax.export.export(program.fn, disabled_checks=DISABLED_CHECKS)(*program.args)
            entry = {"file": f"programs/{name}.jax", "custom_calls": custom_calls(exported)}
            (out / entry["file"]).write_bytes(exported.serialize())
            if compiled:
                entry["compiled"] = f"compiled/{name}.bin"
                (out / entry["compiled"]).write_bytes(executables.to_bytes(engine.programs[name]))
            if name.startswith("forward_"):
                entry["width"] = int(name.removeprefix("forward_"))
            programs[name] = entry
            bar.advance(task)
    # Uncompressed and without OCDBT (a folder per array): restores as fast as OCDBT or zstd and saves twice
    # as fast (tools/gpu_weights_probe.py).
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False)) as ckpt:
        ckpt.save(out.absolute() / PARAMS_DIR, args=ocp.args.PyTreeSave(engine.params))
    source = pathlib.Path(checkpoint)
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    meta = metadata(engine, programs)
    (out / METADATA).write_text(json.dumps(meta, indent=1))
    return meta


def metadata(engine, programs: dict) -> dict:
    cache, config, model = engine.cache, engine.config, engine.model
    groups = [{"window": cache.group_windows[g], "ring_rows": cache.group_ring_rows(g),
               "pages_per_seq": cache.group_pages_per_seq(g), "layers": list(cache.group_layers(g))}
              for g in range(cache.num_groups)]
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "program_abi": PROGRAM_ABI,
        "glint": importlib.metadata.version("glint"), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "platform": platform_name(), "device_kind": jax.devices()[0].device_kind,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {**json.loads(model.to_json()), "num_params": model.num_params, "linears_label": model.linears_label},
        "engine": {"max_seqs": config.max_seqs, "page_size": config.page_size,
                   "max_step_tokens": config.max_step_tokens, "forward_sizes": list(config.forward_sizes),
                   "max_sample_rows": config.max_sample_rows, "min_prefill_chunk": config.min_prefill_chunk,
                   "max_prefill_chunk": config.max_prefill_chunk,
                   "num_pages": cache.num_pages, "capacity": cache.capacity, "attention": engine.attention,
                   "kv_cache_dtype": config.kv_cache_dtype, "tensor_parallel": config.tensor_parallel},
        "cache": {"page_size": cache.page_size, "num_pages": cache.num_pages, "max_seqs": cache.max_seqs,
                  "max_write": cache.max_write, "max_seq_write": cache.max_seq_write, "capacity": cache.capacity,
                  "windows": list(cache.windows),
                  "kv_heads": list(cache.kv_heads), "head_dim": list(cache.head_dim), "dtype": cache.dtype,
                  "groups": groups},
        "signatures": SIGNATURES,
        "widths": list(config.buckets), "decode_widths": list(config.forward_sizes),
        "selected_logit_rows": config.max_sample_rows, "native_context": model.max_position_embeddings,
        "capacity": cache.capacity, "vocab_size": model.vocab_size, "eos_token_ids": list(model.eos_token_ids),
        "programs": programs,
    }
