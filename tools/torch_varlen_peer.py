"""Peer for the attention table: torch.nn.attention.varlen.varlen_attn on the shapes of tools/gpu_kernels.py.

Prints its signature first (it changed across torch releases), then one line per shape. Run on the GPU machine:
  python3 tools/torch_varlen_peer.py
"""
import inspect
import statistics
import time

import torch
from torch.nn.attention import varlen

HQ, HKV, D = 32, 8, 128
PREFILL = [(16, 512), (8, 1024), (4, 2048), (2, 4096)]
DECODE = [(8, 1024), (32, 4096), (64, 16384), (128, 8192), (256, 4096)]


def bench(fn, repeats=10):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(batch, q_len, kv_len, causal, sig):
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(batch * q_len, HQ, D, device=dev, dtype=dt)
    k = torch.randn(batch * kv_len, HKV, D, device=dev, dtype=dt)
    v = torch.randn(batch * kv_len, HKV, D, device=dev, dtype=dt)
    cu_q = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * q_len
    cu_k = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * kv_len
    kwargs = {}
    if causal and "window_size" in sig.parameters:
        kwargs["window_size"] = (-1, 0)
    elif causal and "is_causal" in sig.parameters:
        kwargs["is_causal"] = True
    try:
        fn = lambda: varlen.varlen_attn(q, k, v, cu_q, cu_k, q_len, kv_len, **kwargs)  # noqa: E731
        t, note = bench(fn), "gqa"
    except Exception as e:  # no GQA: repeat the KV heads
        k2, v2 = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        fn = lambda: varlen.varlen_attn(q, k2, v2, cu_q, cu_k, q_len, kv_len, **kwargs)  # noqa: E731
        t, note = bench(fn), f"kv heads repeated ({type(e).__name__})"
    return t, note


def main():
    sig = inspect.signature(varlen.varlen_attn)
    print("torch", torch.__version__, "varlen_attn", sig, flush=True)
    for batch, q_len in PREFILL:
        t, note = run(batch, q_len, q_len, True, sig)
        flops = 4 * batch * HQ * D * q_len * q_len / 2
        print(f"prefill {batch}x{q_len} causal: {1e3 * t:.3f} ms, {flops / t / 1e12:.0f} TFLOP/s [{note}]", flush=True)
    for batch, ctx in DECODE:
        t, note = run(batch, 1, ctx, False, sig)
        kv_bytes = 2 * batch * ctx * HKV * D * 2
        print(f"decode {batch}x{ctx}: {1e6 * t:.1f} us, {kv_bytes / t / 1e9:.0f} GB/s [{note}]", flush=True)


if __name__ == "__main__":
    main()
