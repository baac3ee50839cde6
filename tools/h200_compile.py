"""Compile the engine's step programs for an H200 on a machine without a GPU, and count the kernels they launch.

XLA compiles for a GPU it is only told about (deviceless: the CUDA PJRT plugin's topology built from a target
config, no driver, no device), so this runs on the CPU machines too:
- every Pallas kernel of the step is lowered for sm_90a (Triton's and Mosaic GPU's Python lowering, layouts,
  shared-memory and TMA checks), which the CPU tests' interpreters do not do. Mosaic GPU's own MLIR-to-cubin
  pipeline runs only when an executable is loaded, on a GPU; XLA's fusion and split-K choices are its
  heuristics, not autotuned ones;
- the kernels per layer are counted (the program at `--layers` N+1 minus the one at N). At batch 1 each small
  kernel costs the H200 1.1-1.9 us however little it does (docs/perf.md, "Batch-1 decode"), so the count is
  what a fusion change is judged by before a GPU times it.

Needs the CUDA plugin beside the CPU venv, without its CUDA libraries: `make h200-compile` builds `.venv-h200`
and runs this on the default set. Tuning values: `TUNING=... python tools/with_tuning.py tools/h200_compile.py`.

    python tools/h200_compile.py --quantize none,int4 --widths 1,64
    python tools/h200_compile.py --widths 1 --sequence          # one layer's kernels in launch order
    python tools/h200_compile.py --kernels                      # every variant of gpu_kernels.py's sweep

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the plugin finds no GPU here; the CPU backend stays the default

import jax
from jax.experimental import topologies

# Enough of an H200 (132 SMs, 50 MB L2, 227 KB shared memory a block) for XLA to compile for it:
# stream_executor.GpuTargetConfigProto as text.
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 151397597184 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200"
"""
# Instructions that launch nothing of their own.
FREE = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all", "partition-id", "replica-id"}
_TARGETS = {"__gpu$xla.gpu.triton": "triton", "mosaic_gpu_v2": "mosaic"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*? ([a-z][a-z0-9-]*)\((.*)$")


def h200_device():
    """A compile-only H200, and glint's and Pallas' device checks told that this process targets one."""
    try:
        topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=H200)
    except Exception as e:
        raise SystemExit(f"h200_compile: no CUDA plugin to compile with ({type(e).__name__}: {e}); "
                         "`make h200-compile` installs it in .venv-h200") from e
    from jax._src.pallas.triton import gpu_info

    from glint.model import quant
    from glint.pallas_kernels import varlen_attention_mgpu

    # Both ask the process's first device, which is the CPU here.
    varlen_attention_mgpu.is_hopper = quant.is_hopper = lambda: True
    gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    return topology.devices[0]


def kernels(hlo: str) -> list[tuple[str, str]]:
    """(name, what) of each kernel the optimized module's entry computation launches, in order: fusions by
    kind, custom calls by target (Pallas kernels by their name), and any other instruction that does work."""
    out = []
    for line in hlo[hlo.index("\nENTRY"):].splitlines()[1:]:
        if line.startswith("}"):
            break
        m = _INSTRUCTION.match(line)
        if not m or m.group(2) in FREE:
            continue
        name, op, rest = m.groups()
        if op == "fusion":
            what = "fusion " + (re.search(r"kind=(k\w+)", rest) or re.search("()", "")).group(1)
            if "kCustom" in what:
                what = "gemm" if "gemm_fusion" in name or "__triton_gemm" in rest else what
        elif op == "custom-call":  # a Pallas kernel is named by its call's name scope, less its tile suffix
            target = re.search(r'custom_call_target="([^"]+)"', rest).group(1)
            scope = re.search(r'op_name="[^"]*/([^"/]+)/[^"/]+"', rest)
            kernel = re.sub(r"_[a-z]+\d.*", "", scope.group(1)) if scope else ""
            what = f"{_TARGETS.get(target, target)} {kernel}".strip()
        else:
            what = op
        out.append((name, what))
    return out


def compile_step(device, model: str, layers: int, width: int, quantize: str, kv_cache_dtype: str,
                 capacity: int, page_size: int, max_seqs: int) -> tuple[str, float]:
    """The optimized HLO of forward_`width` for `model` cut to `layers` layers, compiled for `device`."""
    from glint.export.checkpoint import flatten
    from glint.model.presets import preset
    from glint.model.transformer import abstract_model, split
    from glint.runtime.config import EngineConfig
    from glint.runtime.engine import cache_config_for
    from glint.runtime.programs import forward_name
    from glint.runtime.step import live_programs

    cfg = preset(model).replace(num_layers=layers, quantize=quantize)
    _, params = split(abstract_model(cfg))  # shapes only: no weights are made
    max_seqs = max_seqs or max(8, min(width, 256))
    config = EngineConfig(max_seqs=max_seqs, capacity=capacity, max_step_tokens=max(64, width),
                          page_size=page_size, num_pages=max_seqs * -(-capacity // page_size) + 1,
                          kv_cache_dtype=kv_cache_dtype)
    config = config.for_model(cfg.layer_windows, capacity)
    cache = cache_config_for(cfg, config)
    program = live_programs(cfg, flatten(params), cache, "pallas", [width], max_seqs,
                            config.max_sample_rows).programs[forward_name(width)]
    where = jax.sharding.SingleDeviceSharding(device)
    args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), program.args)
    start = time.perf_counter()
    hlo = program.fn.lower(*args).compile().as_text()
    return hlo, time.perf_counter() - start


def lower_sweep(device) -> list[tuple[str, str, str | None]]:
    """Every attention case and kernel variant of `tools/gpu_kernels.py`'s sweep (the CPU test matrix at GPU
    sizes) lowered and compiled for `device`: (case, variant, error or None)."""
    import functools
    import pathlib

    import numpy as np

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from gpu_kernels import case_options, sweep_cases, variant_call

    from glint.pallas_kernels import varlen_attention
    from glint.pallas_kernels.testing import make_attention_inputs

    where = jax.sharding.SingleDeviceSharding(device)
    out = []
    for name, case, variants in sweep_cases():
        inputs = make_attention_inputs(case, np.random.default_rng(0))
        args = {k: v.astype(case.dtype) if v.dtype == np.float32 else v for k, v in inputs.items()}
        for variant, kw in variants:
            call_args, kw = variant_call(args, kw)
            spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=where) for k, v in call_args.items()}
            try:
                jax.jit(functools.partial(varlen_attention, **case_options(case), **kw)).lower(**spec).compile()
                out.append((name, variant, None))
            except Exception as e:  # noqa: BLE001 - keep lowering; the table lists the failure
                out.append((name, variant, f"{type(e).__name__}: {str(e)[:300]}"))
            print(f"{'ok   ' if out[-1][2] is None else 'ERROR'} {name:32s} {variant:18s} {out[-1][2] or ''}",
                  flush=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b", help="a preset (glint.model.presets)")
    p.add_argument("--quantize", default="none", help="weight formats, comma-separated (none,int8,int4,fp8)")
    p.add_argument("--widths", default="1,64", help="step widths, comma-separated")
    p.add_argument("--layers", type=int, default=1, help="compile at N and N+1 layers (per layer = the difference)")
    p.add_argument("--kv-cache-dtype", default="auto", help="as `glint bench --kv-cache-dtype`")
    p.add_argument("--capacity", type=int, default=768, help="positions a sequence may hold (the page tables' width)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-seqs", type=int, default=0,
                   help="sequences a step may hold (default: the width, 8 to 256). A step of more than 4 rows a "
                        "sequence takes the prefill kernels")
    p.add_argument("--sequence", action="store_true", help="print the kernels of the N-layer program in order")
    p.add_argument("--hlo-dir", help="write each optimized module here")
    p.add_argument("--kernels", action="store_true",
                   help="instead: lower every attention case and variant of tools/gpu_kernels.py's sweep")
    args = p.parse_args(argv)

    device = h200_device()
    if args.kernels:
        lowered = lower_sweep(device)
        failed = [(n, v, e) for n, v, e in lowered if e]
        print(f"attention sweep lowered for an H200: {len(lowered) - len(failed)} of {len(lowered)} variants")
        print(json.dumps(dict(lowered=len(lowered), failed=failed)))
        return dict(failed=failed)
    rows = []
    for quantize in args.quantize.split(","):
        for width in map(int, args.widths.split(",")):
            found = {}
            for layers in (args.layers, args.layers + 1):
                hlo, seconds = compile_step(device, args.model, layers, width, quantize, args.kv_cache_dtype,
                                            args.capacity, args.page_size, args.max_seqs)
                found[layers] = kernels(hlo)
                if args.hlo_dir:
                    os.makedirs(args.hlo_dir, exist_ok=True)
                    with open(os.path.join(args.hlo_dir, f"{quantize}_w{width}_l{layers}.hlo.txt"), "w") as f:
                        f.write(hlo)
            few, more = found[args.layers], found[args.layers + 1]
            per_layer = collections.Counter(w for _, w in more)
            per_layer.subtract(collections.Counter(w for _, w in few))
            row = dict(quantize=quantize, width=width, kernels=len(few), per_layer=len(more) - len(few),
                       outside_layers=len(few) - args.layers * (len(more) - len(few)), compile_s=round(seconds, 1),
                       layer_kinds={k: v for k, v in sorted(per_layer.items()) if v})
            rows.append(row)
            if args.sequence:
                print(f"-- {quantize}, width {width}, {args.layers} layer(s):")
                for name, what in few:
                    print(f"   {what:60s} {name}")
    print(f"{args.model} forward_W compiled for an H200 (deviceless), {args.layers} and {args.layers + 1} layers")
    print(f"{'weights':8s} {'width':>5s} {'kernels/layer':>13s} {'outside layers':>14s}  per layer")
    for r in rows:
        kinds = ", ".join(f"{k} {v}" for k, v in r["layer_kinds"].items())
        print(f"{r['quantize']:8s} {r['width']:5d} {r['per_layer']:13d} {r['outside_layers']:14d}  {kinds}")
    result = dict(model=args.model, jax=jax.__version__, rows=rows)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(1 if main().get("failed") else 0)
