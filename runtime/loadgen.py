"""`glint bench MODEL --server URL`: a load generator for an OpenAI-compatible server (glint serve, vLLM, ...).

`requests` streaming completions of `prompt_len` random token ids and exactly `gen_len` generated tokens
(ignore_eos), at most `concurrency` in flight; reports requests/s, output tokens/s, and percentiles of the time to
first token and of the inter-token latency (gaps between a request's streamed chunks, as vLLM's bench measures).
"""
from __future__ import annotations

import asyncio
import json
import time

import numpy as np


def percentiles(values, qs=(50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{q}": float("nan") for q in qs}
    return {f"p{q}": float(np.percentile(values, q)) for q in qs}


async def _one(http, model: str, prompt: list[int], gen_len: int) -> dict:
    """One streaming request: its time to first token, the gaps between its chunks, tokens, latency."""
    import httpx

    body = dict(model=model, prompt=prompt, max_tokens=gen_len, temperature=0, ignore_eos=True, stream=True)
    t0 = time.perf_counter()
    arrivals, num_tokens, done = [], 0, False
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"{response.status_code}: {(await response.aread())[:300]!r}"}
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    continue
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"error": f"error event: {event['error']}"}
                choices = event.get("choices") or []
                got = sum(len(c.get("token_ids") or []) for c in choices) or sum(bool(c.get("text")) for c in choices)
                if got:
                    arrivals.append(time.perf_counter())
                    num_tokens += got
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if not done or not arrivals:
        return {"error": "the stream ended without [DONE]" if not done else "no tokens came back"}
    return {"ttft": arrivals[0] - t0, "itl": np.diff(arrivals).tolist(), "tokens": num_tokens,
            "latency": time.perf_counter() - t0}


async def run_load(url: str, model: str, *, requests: int, concurrency: int, prompt_len: int, gen_len: int,
                   vocab_size: int | None = None, api_key: str | None = None, seed: int = 0) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, limits=limits, timeout=None) as http:
        if vocab_size is None:
            listing = await http.get("/v1/models")
            if listing.status_code != 200:
                raise ValueError(f"{url}/v1/models answered {listing.status_code}: {listing.text[:300]}")
            served = listing.json()["data"]
            vocab_size = next((m.get("vocab_size") for m in served if m["id"] == model), None) or 256
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(0, vocab_size, prompt_len).tolist() for _ in range(requests)]
        gate = asyncio.Semaphore(concurrency)

        async def gated(prompt):
            async with gate:
                return await _one(http, model, prompt, gen_len)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    return {"url": url, "model": model, "requests": requests, "concurrency": concurrency, "prompt_len": prompt_len,
            "gen_len": gen_len, "completed": len(ok), "errors": [r["error"] for r in results if "error" in r][:5],
            "wall_s": wall, "requests_per_s": len(ok) / wall, "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall,
            "ttft_s": percentiles([r["ttft"] for r in ok]),
            "itl_s": percentiles([g for r in ok for g in r["itl"]]),
            "latency_s": percentiles([r["latency"] for r in ok])}


def run_server_bench(args) -> dict:
    from rich.console import Console
    from rich.table import Table

    gen_len = args.e2e_gen_len or args.gen_len
    result = asyncio.run(run_load(args.server, args.model, requests=args.requests,
                                  concurrency=args.concurrency or args.requests, prompt_len=args.prompt_len,
                                  gen_len=gen_len, api_key=args.api_key))
    table = Table(title=f"{args.model} at {args.server}: {result['completed']}/{args.requests} requests of "
                        f"{args.prompt_len} -> {gen_len} tokens, concurrency {result['concurrency']}")
    for col in ("requests/s", "output tok/s", "TTFT p50 / p90 / p99 ms", "ITL p50 / p90 / p99 ms"):
        table.add_column(col, justify="right")
    ms = lambda d: " / ".join(f"{1e3 * d[k]:.1f}" for k in ("p50", "p90", "p99"))  # noqa: E731
    table.add_row(f"{result['requests_per_s']:.2f}", f"{result['output_tokens_per_s']:.0f}", ms(result["ttft_s"]),
                  ms(result["itl_s"]))
    Console().print(table)
    if result["errors"]:
        Console().print(f"[red]errors[/]: {result['errors']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result
