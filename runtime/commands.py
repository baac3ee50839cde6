"""Subcommands that run the engine: generate (streaming) and demo (the built-in default job)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from glint.model.config import QUANT_FORMATS, QUANTIZE_HELP
from glint.runtime.config import KV_CACHE_DTYPES

KV_CACHE_CHOICES = tuple(KV_CACHE_DTYPES)
QUANTIZE_HEAD_HELP = "the LM head (the embedding table too when tied) as int8 per vocab entry"


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default where it has a value (flags and None defaults say theirs in the text)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def _widths(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive step widths."""
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive widths")
    return widths


def _pool_args(p) -> None:
    from glint.runtime.config import EngineConfig as C

    p.add_argument("--num-pages", type=int, help="KV pool pages (default: what --memory-fraction leaves)")
    p.add_argument("--memory-fraction", type=float, help="share of XLA's device memory that the weights, the KV pool "
                   f"and what is already taken may fill, like vLLM's --gpu-memory-utilization (default "
                   f"{C.memory_fraction}; the rest is left to the programs' temporaries)")


def launch_arg(p) -> None:
    p.add_argument("--sync-launch", dest="async_launch", action="store_false",
                   help="launch each step's programs in the engine's loop itself, not from a thread of their own "
                   "beside the host's scheduling and postprocessing")


def _engine_args(p) -> None:
    from glint.runtime.config import EngineConfig as C

    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="weights and KV dtype (default: the checkpoint's torch_dtype; bfloat16 for presets; an "
                   "exported artifact keeps its own)")
    p.add_argument("--max-seqs", type=int, help=f"sequences served at once (default {C.max_seqs})")
    p.add_argument("--page-size", type=int, help=f"KV rows per page (default {C.page_size})")
    p.add_argument("--max-step-tokens", type=int, help=f"widest step (default {C.max_step_tokens})")
    p.add_argument("--max-prefill-chunk", type=int, help="most prompt tokens a sequence feeds per step (default: "
                   "512 for models with sliding-window layers, whose ring holds window + chunk - 1 rows per "
                   "sequence; else --max-step-tokens)")
    p.add_argument("--max-sample-rows", type=int, help="rows of logits a step returns (default: --max-seqs x (1 + "
                   "--num-speculative-tokens)); export with room for the blocks an artifact will verify")
    _pool_args(p)
    p.add_argument("--capacity", type=int, help="most positions per sequence (default: the model's context, "
                   "at most 32768)")
    p.add_argument("--attention", choices=["auto", "pallas", "reference", "interpret"],
                   help="attention implementation (default auto: Pallas on GPU, the jnp reference elsewhere)")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                   help="do not use the persistent compilation cache ($GLINT_CACHE_DIR, default ~/.cache/glint)")
    p.add_argument("--quantize", choices=QUANT_FORMATS,
                   help=f"quantize the linears of an HF folder or preset as they load ({QUANTIZE_HELP}); a converted "
                   "checkpoint keeps the format it was converted to")
    p.add_argument("--quantize-head", action="store_true", help=QUANTIZE_HEAD_HELP + " (HF folders and presets)")
    p.add_argument("--group-size", type=int, help="--quantize int4: input rows per scale (default 128)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_CHOICES,
                   help="the KV cache's element type (default auto: the model's dtype; fp8: float8_e4m3fn with a "
                   "float32 scale per row and head, 0.52x a bf16 cache's bytes at head_dim 128)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not share the KV pages of prompt prefixes between requests (automatic prefix caching)")
    p.add_argument("--tp", "--tensor-parallel", dest="tensor_parallel", type=int,
                   help="split the model over this many local devices: heads, MLP and vocabulary 1/N each, the KV "
                   "cache by KV head (default 1)")
    p.add_argument("--allow-long-context", action="store_true",
                   help="let --capacity exceed the model's max_position_embeddings")
    p.add_argument("--deterministic", action="store_true",
                   help="batch invariance: a request's output is bit-identical whatever shares its steps (every "
                   "step runs at the widest forward size; long prompts prefill in chunks of it)")
    launch_arg(p)
    p.add_argument("--draft", help="speculative decoding: a DFlash draft folder (z-lab layout) or 'ngram' (prompt "
                   "lookup); output stays the model's own")
    p.add_argument("--num-speculative-tokens", type=int, help="--draft: draft tokens verified per step (default: "
                   "the DFlash block size - 1; 4 for ngram)")


def _engine_config(args) -> dict:
    """The engine settings given on the command line (the rest keep EngineConfig's or the artifact's)."""
    names = ("max_seqs", "page_size", "max_step_tokens", "max_prefill_chunk", "max_sample_rows", "num_pages",
             "memory_fraction", "capacity", "attention", "num_speculative_tokens", "kv_cache_dtype", "tensor_parallel")
    given = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    for flag in ("allow_long_context", "deterministic"):
        if getattr(args, flag):
            given[flag] = True
    if not args.async_launch:
        given["async_launch"] = False
    if args.quantize:
        given["quantize"] = args.quantize
    if args.quantize_head:
        given["quantize_head"] = True
    if args.group_size is not None:
        given["quant_group"] = args.group_size
    return given | {"compile_cache": args.compile_cache, "prefix_cache": args.prefix_cache, "draft": args.draft}


def _logit_bias(entries: list[str] | None) -> tuple[tuple[int, float], ...]:
    """--logit-bias ID=BIAS entries as (id, bias) pairs."""
    pairs = []
    for entry in entries or ():
        token, sep, bias = entry.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise ValueError(f"--logit-bias {entry!r}: expected TOKEN_ID=BIAS, e.g. 13=-100") from None
        if not sep:
            raise ValueError(f"--logit-bias {entry!r}: expected TOKEN_ID=BIAS, e.g. 13=-100")
    return tuple(pairs)


def _cmd_generate(args) -> int:
    from glint.runtime.engine import Engine
    from glint.runtime.params import SamplingParams

    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("give exactly one of --prompt TEXT or --prompt-ids '1 2 3'")
    prompt = args.prompt if args.prompt is not None else [int(t) for t in args.prompt_ids.replace(",", " ").split()]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, seed=args.seed, n=args.n, ignore_eos=args.ignore_eos,
                            stop=tuple(args.stop or ()), stop_token_ids=tuple(args.stop_token_ids or ()),
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            repetition_penalty=args.repetition_penalty, logit_bias=_logit_bias(args.logit_bias),
                            min_tokens=args.min_tokens)
    engine = Engine.from_pretrained(args.checkpoint, dtype=args.dtype, **_engine_config(args))
    rid = engine.add_request(prompt, params)
    stream = None
    if engine.tokenizer is not None:  # text as whole characters: a multi-byte one may span several tokens
        from glint.runtime.textstream import TextStream

        stream = TextStream.for_params(engine.tokenizer, params)  # what glint serve streams
    printed = ""
    while engine.has_unfinished():
        engine.step()
        tokens = engine.new_tokens(rid)[0]
        if tokens and not args.json and args.n == 1:
            if stream is None:
                text = " ".join(map(str, tokens)) + " "
            else:
                text = stream.push(tokens)
            printed += text
            sys.stdout.write(text)
            sys.stdout.flush()
    out = engine.output(rid)
    if stream is not None and not args.json and args.n == 1 and out.text.startswith(printed):
        sys.stdout.write(out.text[len(printed):])  # bytes the stream held back for a character never completed
    if args.json:
        print(json.dumps({"prompt_token_ids": out.prompt_token_ids,
                          "outputs": [{"token_ids": c.token_ids, "finish_reason": c.finish_reason, "text": c.text}
                                      for c in out.outputs]}))
    elif args.n > 1:
        for i, c in enumerate(out.outputs):
            print(f"[{i}] {c.text if c.text is not None else ' '.join(map(str, c.token_ids))} ({c.finish_reason})")
    else:
        accepted = (f", {engine.stats.mean_acceptance_length:.2f} tokens per speculative step"
                    if engine.stats.spec_steps else "")
        print(f"\n[{out.finish_reason}{accepted}]")
    return 0


def _cmd_serve(args) -> int:
    import os
    import pathlib

    from glint.runtime.engine import Engine
    from glint.runtime.chat import load_chat_template
    from glint.runtime.server import serve

    api_key = args.api_key or os.environ.get("GLINT_API_KEY") or None
    name = args.served_model_name or pathlib.Path(args.model).name
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, **_engine_config(args))
    chat = load_chat_template(args.model) if pathlib.Path(args.model).is_dir() else None
    engine.warmup(progress=sys.stderr.isatty())  # every program compiled before the first request
    print(f"glint: serving {name} on http://{args.host}:{args.port}"
          f"{' (API key required)' if api_key else ''}", flush=True)
    serve(engine, name, host=args.host, port=args.port, api_key=api_key, chat=chat)
    return 0


def _cmd_demo(args) -> int:
    import jax
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from glint.runtime.engine import Engine
    from glint.runtime.params import SamplingParams

    if args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, max_seqs=32, page_size=16, max_step_tokens=256,
                                    compile_cache=args.compile_cache)  # capacity: the model's context
    rng = np.random.default_rng(args.seed)
    vocab = engine.model.vocab_size
    prompts = [rng.integers(3, vocab, int(rng.integers(4, 200))).tolist() for _ in range(args.requests)]
    params = [SamplingParams(max_tokens=int(rng.integers(8, 64)), temperature=float(rng.choice([0.0, 0.8])),
                             top_p=0.95, seed=i, ignore_eos=True) for i in range(args.requests)]
    t0 = time.perf_counter()
    engine.warmup()
    t1 = time.perf_counter()
    outs = engine.generate(prompts, params, progress=True)
    t2 = time.perf_counter()
    s = engine.stats
    table = Table(title=f"glint demo: {args.model} ({engine.model.num_params:,} parameters) on "
                        f"{jax.devices()[0].platform}, attention={engine.attention}")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("requests", str(len(outs)))
    table.add_row("prompt tokens", str(sum(len(p) for p in prompts)))
    table.add_row("generated tokens", str(sum(len(o.token_ids) for o in outs)))
    table.add_row("generated tokens/s", f"{s.generated_tokens / (t2 - t1):.1f}")
    table.add_row("wall time (s)", f"{t2 - t1:.2f} (+{t1 - t0:.1f} compile)")
    table.add_row("host busy / waiting on device (s)", f"{s.host_seconds:.2f} / {s.wait_seconds:.2f}")
    table.add_row("preemptions", str(s.preemptions))
    table.add_row("steps per bucket", ", ".join(f"{w}: {n}" for w, n in sorted(s.steps_per_bucket.items())))
    Console().print(table)
    print("first request:", outs[0].token_ids[:16], outs[0].finish_reason)
    return 0


def _cmd_export(args) -> int:
    from glint.export.exporter import export_engine

    settings = _engine_config(args)
    if settings.pop("draft") or "num_speculative_tokens" in settings:
        raise ValueError("glint export takes no --draft: an artifact speculates with a host drafter given when it "
                         "is served (glint serve ARTIFACT --draft ngram)")
    meta = export_engine(args.checkpoint, args.out, dtype=args.dtype, compiled=args.compiled, **settings)
    kernels = sorted({c for p in meta["programs"].values() for c in p["custom_calls"]})
    executables = any("compiled" in p for p in meta["programs"].values())
    print(f"wrote {args.out}: {len(meta['programs'])} programs (widths {meta['widths']}), "
          f"{meta['engine']['num_pages']} KV pages of {meta['engine']['page_size']} rows, attention "
          f"{meta['engine']['attention']} (kernels: {', '.join(kernels) or 'none'}), "
          f"{'with' if executables else 'without'} executables for {meta['device_kind']}")
    return 0


def register(sub) -> None:
    _register_bench(sub)
    p = sub.add_parser("export", help="export the step programs, weights and metadata into a folder",
                       formatter_class=Help,
                       description="Export an engine: one jax.export program per step width (plus sampling, "
                       "logprobs and page copies), the weights (orbax) and metadata.json. Serve it with "
                       "`glint generate OUT` or Engine.from_export(OUT).")
    p.add_argument("checkpoint", help="HF folder, orbax folder or preset name")
    p.add_argument("out", help="output folder (must not exist, or be empty)")
    p.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                   help="also store the executables compiled for this GPU and jaxlib (default: on a GPU)")
    _engine_args(p)
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("generate", help="generate from one prompt, streaming tokens as they come",
                       formatter_class=Help)
    p.add_argument("checkpoint", help="HF folder, orbax folder or preset name")
    p.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    p.add_argument("--prompt-ids", help="prompt token ids, e.g. '1 2 3'")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 or -1: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (1: all)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep the tokens at least this times as likely as the likeliest (0: all)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of each token already generated ([-2, 2]; 0: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per time a token was generated ([-2, 2]; 0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides the positive logits of the prompt's and the output's tokens, multiplies the "
                        "negative ones (> 0; 1: off)")
    p.add_argument("--logit-bias", action="append", metavar="ID=BIAS",
                   help="add BIAS ([-100, 100]) to token ID's logit before the penalties (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0,
                   help="generate at least this many tokens before a stop token or stop string may end the output")
    p.add_argument("--seed", type=int, default=None, help="the request's seed (default: drawn from the OS)")
    p.add_argument("--n", type=int, default=1, help="completions to sample")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the model's EOS tokens")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop where the text first contains TEXT, which is not printed (repeatable; needs a tokenizer)")
    p.add_argument("--stop-token-ids", type=int, nargs="+", metavar="ID", help="stop after any of these tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    _engine_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming)",
                       formatter_class=Help)
    p.add_argument("model", help="HF folder, orbax folder, exported artifact or preset name")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ (default: $GLINT_API_KEY)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the folder's name)")
    _engine_args(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("demo", help="the built-in default job: 64 random requests on the demo model",
                       formatter_class=Help)
    p.add_argument("--model", default="demo", help="preset name or checkpoint folder")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"], help="weights and KV dtype")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                   help="do not use the persistent compilation cache ($GLINT_CACHE_DIR, default ~/.cache/glint)")
    p.add_argument("--requests", type=int, default=64, help="random requests to run")
    p.add_argument("--seed", type=int, default=0, help="seed of the random requests")
    p.set_defaults(func=_cmd_demo)


# What `glint bench` measures when not told: the H200 tables' sizes on a GPU; on a CPU, sizes that finish in
# well under a minute on 2 cores (the numbers then only show that everything runs).
GPU_DEFAULTS = dict(batch="1,8,32,64,128", prompt_len=512, gen_len=256, requests=256, max_step_tokens=4096,
                    repeats=10)
CPU_DEFAULTS = dict(batch="1,4", prompt_len=32, gen_len=8, requests=8, max_step_tokens=128, repeats=3)


def fill_defaults(args, on_gpu: bool) -> None:
    for name, value in (GPU_DEFAULTS if on_gpu else CPU_DEFAULTS).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def _cmd_bench(args) -> int:
    if args.server:
        import os

        from glint.runtime.loadgen import run_server_bench

        fill_defaults(args, on_gpu=True)  # the sizes of a served model's load, whatever runs this client
        args.api_key = args.api_key or os.environ.get("GLINT_API_KEY")
        result = run_server_bench(args)
        return 0 if result["completed"] == args.requests else 1
    from glint.runtime.bench import run_bench

    run_bench(args)
    return 0


def _register_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark step buckets, decode throughput and an end-to-end run",
                       formatter_class=Help)
    p.add_argument("model", help="preset name (random weights) or checkpoint folder")
    p.add_argument("--batch", help="decode batch sizes (default: 1,8,32,64,128 on a GPU, 1,4 on a CPU)")
    p.add_argument("--contexts", default="", help="decode contexts, e.g. 512,4096 (default prompt + gen/2)")
    p.add_argument("--prompt-len", type=int, help="default: 512 on a GPU, 32 on a CPU")
    p.add_argument("--gen-len", type=int, help="default: 256 on a GPU, 8 on a CPU")
    p.add_argument("--requests", type=int, help="end-to-end requests (0: skip; default: 256 on a GPU, 8 on a CPU)")
    p.add_argument("--e2e-gen-len", type=int, default=0, help="generated tokens per end-to-end request "
                   "(default --gen-len)")
    p.add_argument("--length-spread", type=float, default=0.0,
                   help="end-to-end prompt and output lengths uniform within +- this fraction (0: fixed)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-step-tokens", type=int, help="default: 4096 on a GPU, 128 on a CPU")
    p.add_argument("--forward-sizes", type=_widths, help="the narrow step widths, comma-separated (default: the engine's up to "
                   "--max-step-tokens); e.g. --forward-sizes 256 --max-step-tokens 256 compiles one program")
    p.add_argument("--attention", default="auto", choices=["auto", "pallas", "reference", "interpret"])
    _pool_args(p)
    launch_arg(p)
    p.add_argument("--repeats", type=int, help="default: 10 on a GPU, 3 on a CPU")
    p.add_argument("--bandwidth-gbps", type=float, default=0.0,
                   help="roofline bandwidth (default: the best this harness measures)")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--peer-json", help="JSON lines of a peer's end-to-end run on the same mix (tools/hf_peer.py)")
    p.add_argument("--cold-start", action="store_true",
                   help="instead: seconds from process start to the first token in fresh processes, with an empty "
                   "compilation cache, a warm one and an exported artifact")
    p.add_argument("--workdir", help="--cold-start: where the temporary cache and artifact go (default: system temp)")
    p.add_argument("--ways", default="no-cache,warm,artifact",
                   help="--cold-start: which ways to time (also artifact-again: a second process on the artifact)")
    p.add_argument("--no-compile-cache", dest="compile_cache", action="store_false",
                   help="do not use the persistent compilation cache ($GLINT_CACHE_DIR, default ~/.cache/glint)")
    p.add_argument("--quantize", choices=QUANT_FORMATS, default=None,
                   help=f"the model's linears in this weight format ({QUANTIZE_HELP})")
    p.add_argument("--quantize-head", action="store_true", help=QUANTIZE_HEAD_HELP)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_CHOICES, default="auto",
                   help="the KV cache's element type (auto: the model's dtype; fp8: float8_e4m3fn)")
    p.add_argument("--tp", "--tensor-parallel", dest="tensor_parallel", type=int, default=1,
                   help="split the model over this many local devices (the roofline: their summed bandwidth)")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="instead: the prefix cache on and off, --requests prompts of this many shared tokens + "
                        "--prompt-len of their own -> --gen-len (and the same lengths sharing nothing)")
    p.add_argument("--draft", help="instead: plain against speculative decoding with this drafter (ngram, oracle) "
                   "at each --batch, --prompt-len -> --gen-len tokens")
    p.add_argument("--num-speculative-tokens", type=int, help="--draft: draft tokens per step (default 4; "
                   "dflash-random: 15)")
    p.add_argument("--quote", type=int, default=1, help="--draft: each prompt is a random passage of "
                   "--prompt-len / N tokens written over and over (prompts that quote themselves; default 1: random "
                   "tokens)")
    p.add_argument("--server", help="instead: load a running OpenAI-compatible server at this URL (MODEL is the "
                   "served model name): --requests streaming completions of --prompt-len -> --gen-len tokens")
    p.add_argument("--concurrency", type=int, default=0, help="--server: requests in flight at most (0: all)")
    p.add_argument("--api-key", help="--server: the server's API key (default: $GLINT_API_KEY)")
    p.set_defaults(func=_cmd_bench)
