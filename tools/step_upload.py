"""Host cost of one decode step's metadata: B sequences prefilled to CONTEXT through BatchControl (llama3-8b's
cache geometry, page 16), then 200 decode steps of all of them, each declare_step + prepare_step +
StepLayout.pack + commit_step timed on the host. Prints the upload's size and the median time per step.

  python3 tools/step_upload.py B CAPACITY CONTEXT
"""
import sys
import time

import numpy as np
from glint.kvcache import BatchControl, CacheConfig
from glint.runtime.programs import DeviceMeta, StepLayout, num_segments

STEPS = 200


def main(batch: int, capacity: int, context: int) -> None:
    if context + STEPS > capacity:
        raise SystemExit(f"context {context} + {STEPS} decode steps pass capacity {capacity}")
    cache = CacheConfig(page_size=16, num_pages=batch * capacity // 16 + 8, max_seqs=batch, max_write=256,
                        capacity=capacity, windows=(0,) * 32, kv_heads=(8,) * 32, head_dim=(128,) * 32,
                        dtype="bfloat16")
    control = BatchControl(cache)
    seqs = [control.seq_new() for _ in range(batch)]
    for seq in seqs:
        for done in range(0, context, 256):
            assert control.declare_step([seq] * min(256, context - done))
            control.prepare_step()
            control.commit_step()
    layout = StepLayout.of(batch, cache, batch, batch)
    tokens, rows = np.zeros(batch, np.int32), np.arange(batch, dtype=np.int32)
    times = []
    for _ in range(STEPS):
        t = time.perf_counter()
        assert control.declare_step(seqs)
        meta = control.prepare_step(width=batch, num_segments=num_segments(batch, batch))
        host = layout.pack(tokens, tokens - 1, DeviceMeta.from_host(meta), rows)
        control.commit_step()
        times.append(time.perf_counter() - t)
    print(f"batch {batch}, capacity {capacity}, context {context}: upload {4 * host.size / 1024:.1f} KiB, "
          f"prepare + pack {1e6 * np.median(times):.0f} us per step")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
