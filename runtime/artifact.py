"""Loading a `glint export` folder: metadata, the serialized programs, the weights. No glint.model import.

Layout of an artifact folder:
  metadata.json          model, cache geometry, engine limits, programs, versions, GPU, date
  programs/NAME.jax      one `jax.export.Exported` (StableHLO, kernels inside) per program
  compiled/NAME.bin      optional: the executable compiled for `device_kind` with this jaxlib
  params/                the weights, as the orbax checkpoint `glint convert` writes
  tokenizer.json, ...    the checkpoint's side files, when it had them
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import pathlib
import time
from dataclasses import dataclass

import jax
import jaxlib
import numpy as np

from glint.kvcache import CacheConfig
from glint.runtime import executables, weights
from glint.runtime.config import KV_CACHE_DTYPES, EngineConfig
from glint.runtime.programs import (RUNTIME_PROGRAMS, START_PROGRAMS, Program, ProgramSet, abstract_args,
                                    donate_argnums, forward_name, penalize_names)
from glint.runtime.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

METADATA = "metadata.json"
FORMAT = "glint-export"
FORMAT_VERSION = 1
# The programs' calling convention (argument order and meaning, `glint.runtime.programs`): bump on any change,
# since shapes and dtypes alone cannot tell e.g. temperature from top_p.
PROGRAM_ABI = 15  # 2: kv_init; 3: one packed host input per step (programs.StepLayout); 4: fp8 pools carry scales;
# 5: the packed input's arrays start at 256-byte boundaries; 6: the page tables stay on the device, a step
# uploads the entries set since the last one (the `tables` program sends more); 7: int8 and int4 weights
# stored [out, in] (model/config.QUANT_LAYOUT); 8: int4 scales stored [groups, out]; 9: fp8 KV scale pools
# [num_pages, kv_heads, page_size]; 10: the sampler's min_p column; 11: the forward's own draw applies min_p (the
# `sample` program is for top-k/top-p); 12: the `penalize` program; 13: `penalize` takes logit biases; 14: and
# allowed tokens; 15: penalize_H, one per history width
PARAMS_DIR = "params"
# EngineConfig fields the programs are built for: a caller may repeat them, not change them.
GEOMETRY_FIELDS = ("max_seqs", "page_size", "max_step_tokens", "forward_sizes", "max_sample_rows", "num_pages",
                   "capacity", "max_prefill_chunk", "tensor_parallel")
MOSAIC_GPU_CALL = "mosaic_gpu_v2"


@dataclass(frozen=True)
class ModelInfo:
    """What the host loop knows of an exported model (the full config stays in metadata.json)."""

    model_type: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_params: int
    tie_embeddings: bool
    max_position_embeddings: int
    dtype: str
    quantize: str = "none"  # older artifacts may record none of these three
    quantize_head: bool = False
    linears_label: str = ""  # ModelConfig.linears_label, recorded at export

    def replace(self, **changes) -> ModelInfo:
        return dataclasses.replace(self, **changes)


@dataclass
class Artifact:
    folder: pathlib.Path
    metadata: dict
    model: ModelInfo
    config: EngineConfig
    cache: CacheConfig
    attention: str
    programs: ProgramSet
    params: dict
    tokenizer: object
    seconds: dict  # loading time per part: programs (StableHLO), executables, params


def is_artifact(path) -> bool:
    return isinstance(path, (str, pathlib.Path)) and (pathlib.Path(path) / METADATA).is_file()


def platform_name() -> str:
    """The platform name jax.export uses for this process's default backend."""
    platform = jax.devices()[0].platform
    return "cuda" if platform == "gpu" else platform


def read_metadata(folder: pathlib.Path) -> dict:
    path = folder / METADATA
    if not path.is_file():
        raise ValueError(f"{folder} is not a glint export: {METADATA} is missing")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the artifact is damaged, export it again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not glint export metadata (format {FORMAT!r} expected)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {meta.get('format_version')!r}, this glint reads {FORMAT_VERSION}")
    if meta.get("program_abi") != PROGRAM_ABI:
        raise ValueError(f"{path}: programs of calling convention {meta.get('program_abi')!r}, this glint runs "
                         f"{PROGRAM_ABI}; export it again")
    missing = [k for k in ("jax", "jaxlib", "platform", "model", "engine", "cache", "programs") if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks {missing}; the artifact is damaged, export it again")
    return meta


def check_compatible(meta: dict, folder: pathlib.Path) -> None:
    """The artifact's jax/jaxlib versions and platform must be this process's."""
    for name, have in (("jax", jax.__version__), ("jaxlib", jaxlib.__version__)):
        if meta[name] != have:
            raise ValueError(f"{folder} was exported with {name} {meta[name]}, this process runs {name} {have}; "
                             f"export it again with {name} {have}")
    if meta["platform"] != platform_name():
        raise ValueError(f"{folder} was exported for {meta['platform']}, this process runs on {platform_name()}")


def engine_config(meta: dict, folder: pathlib.Path, overrides: dict) -> EngineConfig:
    """The exported EngineConfig with the caller's overrides, which may not change the geometry."""
    exported = dict(meta["engine"])
    exported.setdefault("tensor_parallel", 1)  # artifacts from before tensor parallelism
    exported["forward_sizes"] = tuple(exported["forward_sizes"])
    exported.setdefault("max_prefill_chunk", exported["max_step_tokens"])  # artifacts from before the limit
    for name in GEOMETRY_FIELDS:
        if name in overrides and overrides[name] is not None:
            asked = tuple(sorted(set(overrides[name]))) if name == "forward_sizes" else overrides[name]
            if asked != exported[name]:
                raise ValueError(f"{folder} was exported with {name}={exported[name]}; asked {name}={asked}. "
                                 f"Export again with the geometry you need")
    attention = overrides.get("attention", "auto")
    if attention not in ("auto", exported["attention"]):
        raise ValueError(f"{folder} was exported with attention={exported['attention']}; asked {attention}")
    exported.setdefault("kv_cache_dtype", "auto")  # artifacts from before fp8 caches
    kv = overrides.get("kv_cache_dtype")
    if kv is not None and kv != "auto" and KV_CACHE_DTYPES.get(kv, kv) != meta["cache"]["dtype"]:
        raise ValueError(f"{folder} was exported with a {meta['cache']['dtype']} KV cache; asked kv_cache_dtype="
                         f"{kv!r}. Export again with the cache you need")
    fields = {k: v for k, v in overrides.items() if k not in (*GEOMETRY_FIELDS, "attention", "kv_cache_dtype")}
    return EngineConfig(**{**exported, **fields})


def cache_config(meta: dict) -> CacheConfig:
    c = meta["cache"]
    return CacheConfig(page_size=c["page_size"], num_pages=c["num_pages"], max_seqs=c["max_seqs"],
                       max_write=c["max_write"], max_seq_write=c.get("max_seq_write", c["max_write"]),
                       capacity=c["capacity"], windows=tuple(c["windows"]),
                       kv_heads=tuple(c["kv_heads"]), head_dim=tuple(c["head_dim"]), dtype=c["dtype"])


def _read_bytes(path: pathlib.Path) -> bytes:
    if not path.is_file():
        raise ValueError(f"{path} is missing; the artifact is incomplete, export it again")
    return path.read_bytes()


def mesh_for(n: int, folder: pathlib.Path) -> jax.sharding.Mesh | None:
    """The 1-D mesh over the first `n` devices that an artifact exported with tensor_parallel=n runs on (None: one
    device)."""
    if n == 1:
        return None
    if n > len(jax.devices()):
        raise ValueError(f"{folder} was exported with tensor_parallel={n}; this process has {len(jax.devices())} "
                         f"{jax.default_backend()} device(s)")
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("tp",))


def load_program(folder: pathlib.Path, name: str, entry: dict, mesh: jax.sharding.Mesh | None = None) -> Program:
    """One exported program as a jitted call of its StableHLO (over `mesh`, with the shardings it was exported
    with, when it was exported for several devices)."""
    path = folder / entry["file"]
    data = _read_bytes(path)
    try:
        exported = jax.export.deserialize(bytearray(data))
    except Exception as e:  # flatbuffer / MLIR errors of a truncated or foreign file
        raise ValueError(f"{path} is not a readable jax.export program ({type(e).__name__}: {e}); "
                         "the artifact is damaged, export it again") from None
    avals, outs = exported.in_avals, None
    if mesh is not None:  # the shardings it was exported with; the outputs' also tell kv_init (no inputs) where to run
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                 for a, s in zip(avals, exported.in_shardings_jax(mesh))]
        outs = jax.tree.unflatten(exported.out_tree, exported.out_shardings_jax(mesh))
    args = jax.tree.unflatten(exported.in_tree, avals)[0]
    placed = {} if outs is None else {"out_shardings": outs}
    return Program(jax.jit(exported.call, donate_argnums=donate_argnums(name), **placed), args)


def check_args(folder: pathlib.Path, name: str, args, expected) -> None:
    specs = lambda tree: [(tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(tree)]  # noqa: E731
    if jax.tree.structure(args) != jax.tree.structure(expected) or specs(args) != specs(expected):
        raise ValueError(f"{folder / 'programs' / name}: its arguments do not match the geometry in {METADATA}; "
                         "the artifact is inconsistent, export it again")


def load_compiled(folder: pathlib.Path, meta: dict, name: str) -> jax.stages.Compiled | None:
    """The serialized executable of `name` when it was built for this GPU and jaxlib; else None (logged).

    Executables are pickled: load only artifacts you trust, or pass compiled=False (the StableHLO is then
    compiled, which runs no code from the artifact)."""
    entry = meta["programs"][name]
    if not entry.get("compiled"):
        return None
    device_kind = jax.devices()[0].device_kind
    if meta.get("device_kind") != device_kind:
        log.info("%s: executables were built on %s, this is %s: compiling the StableHLO", folder,
                 meta.get("device_kind"), device_kind)
        return None
    path = folder / entry["compiled"]
    try:
        return executables.from_bytes(_read_bytes(path))
    except Exception as e:  # a damaged executable is not fatal: the StableHLO is there
        log.warning("%s could not be loaded (%s: %s); compiling the StableHLO instead", path, type(e).__name__, e)
        return None


def load_params(folder: pathlib.Path, like: dict, device=None, mesh: jax.sharding.Mesh | None = None) -> dict:
    """The flat weights from `params/`, shaped and typed as the forward programs take them, on the device (or
    on `weights.start_device()`'s once it has started); with a tensor-parallel `mesh`, each array's shards onto
    their devices, in the sharding of its spec in `like`."""
    path = folder / PARAMS_DIR
    if not path.is_dir():
        raise ValueError(f"{path} is missing; the artifact has no weights")
    place = None if mesh is None else lambda name, host: jax.device_put(host, like[name].sharding)  # noqa: E731
    return weights.read_params(path, like, device, place=place)


def _timed(fn, *args):
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def load_artifact(folder, dtype: str | None = None, compiled: bool = True, **overrides) -> Artifact:
    """Read an artifact folder; `overrides` are EngineConfig fields (geometry must equal the exported)."""
    folder = pathlib.Path(folder)
    meta = read_metadata(folder)
    check_compatible(meta, folder)
    device = weights.start_device()  # the GPU client starts while the programs and weights are read
    if dtype is not None and dtype != meta["model"]["dtype"]:
        raise ValueError(f"{folder} was exported with dtype {meta['model']['dtype']}; asked {dtype}")
    config = engine_config(meta, folder, overrides)
    cache = cache_config(meta)
    model = ModelInfo(**{f.name: meta["model"][f.name] for f in dataclasses.fields(ModelInfo)
                         if f.name != "eos_token_ids" and f.name in meta["model"]},
                      eos_token_ids=tuple(meta["model"]["eos_token_ids"]))
    if any(MOSAIC_GPU_CALL in entry.get("custom_calls", ()) for entry in meta["programs"].values()):
        import jax.experimental.mosaic.gpu  # noqa: F401  (registers the Mosaic GPU runtime its kernels call)
    t0 = time.perf_counter()
    needed = ({forward_name(w) for w in config.buckets} | set(RUNTIME_PROGRAMS) | set(START_PROGRAMS)
              | set(penalize_names(cache.capacity)))
    missing, unknown = sorted(needed - set(meta["programs"])), sorted(set(meta["programs"]) - needed - {"sample_argmax"})
    if missing or unknown:
        raise ValueError(f"{folder / METADATA}: programs missing {missing}, unknown {unknown}; export it again")
    mesh = mesh_for(config.tensor_parallel, folder)
    programs = {name: load_program(folder, name, entry, mesh) for name, entry in meta["programs"].items()}
    forwards = [p for name, p in programs.items() if name.startswith("forward_")]
    if not forwards:
        raise ValueError(f"{folder / METADATA} lists no forward programs")
    params_like = forwards[0].args[0]
    for name, program in programs.items():
        check_args(folder, name, program.args, abstract_args(name, params_like, cache, config.max_seqs,
                                                             config.max_sample_rows, model.vocab_size))
    t1 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(programs) + 1) as pool:
        params_future = pool.submit(_timed, load_params, folder, params_like, device, mesh)  # streams in meanwhile
        executables = pool.map(lambda name: (name, load_compiled(folder, meta, name)), programs if compiled else [])
        loaded = {name: executable for name, executable in executables if executable is not None}
        t2 = time.perf_counter()
        params, params_s = params_future.result()
    seconds = dict(programs=t1 - t0, executables=t2 - t1, params=params_s,
                   params_and_executables=time.perf_counter() - t1)
    return Artifact(folder, meta, model, config, cache, meta["engine"]["attention"], ProgramSet(programs, loaded),
                    params, load_tokenizer(folder), seconds)
