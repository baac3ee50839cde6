"""KV cache bytes one sequence holds, by the ring geometry, before and after the per-sequence prefill chunk limit.

  python tools/kv_per_seq.py [--capacity 32768] [--chunk 512] [PRESET ...]   (arithmetic only, no device)
"""
import argparse

from glint.kvcache import CacheConfig
from glint.model.presets import preset


def per_seq_bytes(cache: CacheConfig) -> int:
    return sum(cache.group_pages_per_seq(cache.layer_group[layer]) * cache.page_bytes(layer)
               for layer in range(cache.num_layers))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("presets", nargs="*", default=["muse-glimmer-30b", "gemma3-4b"])
    parser.add_argument("--capacity", type=int, default=32768)
    parser.add_argument("--max-step-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    print("model | sliding layers (window) | ring rows before -> after | KV per sequence MiB before -> after")
    for name in args.presets:
        model = preset(name)
        caches = [CacheConfig(page_size=16, num_pages=2, max_seqs=1, max_write=args.max_step_tokens,
                              max_seq_write=w, capacity=args.capacity, windows=model.layer_windows,
                              kv_heads=model.num_kv_heads, head_dim=model.head_dim, dtype="bfloat16")
                  for w in (args.max_step_tokens, args.chunk)]
        rings = [g for g in range(caches[0].num_groups) if caches[0].is_ring(g)]
        layers = ", ".join(f"{len(caches[0].group_layers(g))} ({caches[0].group_windows[g]})" for g in rings)
        rows = ", ".join(f"{caches[0].group_ring_rows(g)} -> {caches[1].group_ring_rows(g)}" for g in rings)
        before, after = (per_seq_bytes(c) / 2**20 for c in caches)
        print(f"{name} | {layers} of {model.num_layers} | {rows} | {before:.1f} -> {after:.1f} "
              f"({100 * (after / before - 1):+.0f} %)")


if __name__ == "__main__":
    main()
