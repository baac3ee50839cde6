"""`glint bench --cold-start`: seconds from process start to the first token, each way in a fresh process.

Three ways: an empty compilation cache (everything compiles), the cache that run left behind (warm), and
an exported artifact (its stored executables on a GPU; on a CPU its StableHLO, compiled into an empty
cache). Each child builds the engine, warms it up (every program, as a server does before it serves) and
generates one greedy token; it prints one JSON line of timestamps, which the parent turns into seconds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CHILD_PREFIX = "coldstart: "


def child(argv: list[str]) -> None:
    """python -m glint.runtime.coldstart SOURCE ENGINE_CONFIG_JSON: build, warm up, first token, print times."""
    t_start = time.time()
    import jax

    from glint.runtime import executables
    from glint.runtime.engine import Engine
    from glint.runtime.params import SamplingParams

    events: list[str] = []  # XLA compilations (cache hits included) and persistent-cache hits
    jax.monitoring.register_event_duration_secs_listener(lambda event, duration, **kw: events.append(event))
    jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
    t_import = time.time()
    source, config = argv[0], json.loads(argv[1])
    engine = Engine.from_pretrained(source, **config)
    t_load = time.time()
    loaded = engine.programs.num_compiled  # executables an artifact brought ready to run
    engine.warmup(progress=False)
    t_warm = time.time()
    # A 300-token prompt (prefill kernels) and 16 greedy tokens (decode): the ways must agree on all of them.
    prompt = [(7 * i + 3) % engine.model.vocab_size for i in range(300)]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    t_first = None
    while engine.has_unfinished():
        if engine.step().get(rid) and t_first is None:
            t_first = time.time()
    out = engine.output(rid)
    hits = events.count("/jax/compilation_cache/cache_hits")
    compiles = events.count("/jax/core/compile/backend_compile_duration") - hits
    print(CHILD_PREFIX + json.dumps(dict(start=t_start, imported=t_import, loaded=t_load, warm=t_warm,
                                         first_token=t_first, token_ids=out.token_ids, compiles=compiles,
                                         cache_hits=hits, executables_loaded=loaded,
                                         load_parts=getattr(engine, "load_seconds", None),
                                         executables_cache=dict(executables.counts))), flush=True)


def export_child(argv: list[str]) -> None:
    """python -m glint.runtime.coldstart --export SOURCE OUT ENGINE_CONFIG_JSON"""
    from glint.export.exporter import export_engine

    source, out, config = argv[0], argv[1], json.loads(argv[2])
    export_engine(source, out, show_progress=False, **config)
    print(CHILD_PREFIX + json.dumps({}), flush=True)


def _child_process(args: list[str], cache_dir: str, timeout: float) -> tuple[dict, float, float]:
    """Run a child in a fresh process (the parent never touches the device); (its JSON, start, wall seconds)."""
    env = dict(os.environ, GLINT_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "glint.runtime.coldstart", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    wall = time.time() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith(CHILD_PREFIX)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr)
        raise RuntimeError(f"cold-start child {args[:2]} failed (exit {proc.returncode}): {proc.stderr[-500:]}")
    return json.loads(lines[-1].removeprefix(CHILD_PREFIX)), t0, wall


def _run_child(source: str, config: dict, cache_dir: str, timeout: float) -> dict:
    t, t0, wall = _child_process([source, json.dumps(config)], cache_dir, timeout)
    return dict(process_s=wall, python_to_import_s=t["imported"] - t0, load_s=t["loaded"] - t["imported"],
                warmup_s=t["warm"] - t["loaded"], first_token_s=t["first_token"] - t0, token_ids=t["token_ids"],
                compiles=t["compiles"], cache_hits=t["cache_hits"], executables_loaded=t["executables_loaded"],
                load_parts=t["load_parts"], executables_cache=t["executables_cache"])


WAYS = ("no-cache", "warm", "artifact", "artifact-again")  # artifact-again: a second process on the same one


def cold_start(source: str, dtype: str | None, engine_config: dict, workdir: str | None = None,
               timeout: float = 1800, ways: tuple[str, ...] = WAYS[:3]) -> list[dict]:
    """Time the ways asked (in this order; "warm" reuses the cache "no-cache" filled); one dict per way
    (seconds from process start, and the parts)."""
    unknown = set(ways) - set(WAYS)
    if unknown:
        raise ValueError(f"unknown cold-start ways {sorted(unknown)}; choose from {WAYS}")
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        cache, artifact_cache = os.path.join(tmp, "cache"), os.path.join(tmp, "artifact-cache")
        config = dict(engine_config, dtype=dtype)
        rows = []
        for way, name in (("no-cache", "no cache"), ("warm", "warm cache")):
            if way in ways:
                rows.append(dict(way=name, **_run_child(source, config, cache, timeout)))
                print(CHILD_PREFIX + json.dumps(rows[-1]), flush=True)  # each way as it is measured
        if not {"artifact", "artifact-again"} & set(ways):
            return rows
        artifact = os.path.join(tmp, "artifact")
        _, _, export_s = _child_process(["--export", source, artifact, json.dumps(config)], cache,
                                          timeout)
        t0 = time.time()
        os.sync()  # an artifact is served long after it was written: none of its pages still being written back
        sync_s = time.time() - t0
        for name in ("exported artifact", "artifact again")[:1 + ("artifact-again" in ways)]:
            rows.append(dict(way=name, export_s=export_s, sync_s=sync_s,
                             **_run_child(artifact, {"compile_cache": engine_config.get("compile_cache", True)},
                                          artifact_cache, timeout)))
            print(CHILD_PREFIX + json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    export_child(sys.argv[2:]) if sys.argv[1] == "--export" else child(sys.argv[1:])
