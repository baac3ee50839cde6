"""Peer for `glint bench`: HF transformers' continuous batching on the same random-weight llama3-8b shape.

Run on the GPU machine (torch + transformers there): prints one JSON line per configuration.
  python tools/hf_peer.py --requests 256 --prompt-len 512 --gen-len 128
"""
import argparse
import inspect
import json
import time

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM


def build_model(attn: str):
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 8192},
                      tie_word_embeddings=False)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def run(model, prompts, gen_len, cb_config):
    gen = GenerationConfig(max_new_tokens=gen_len, do_sample=False, eos_token_id=-1)
    kwargs = {}
    if cb_config is not None:
        kwargs["continuous_batching_config"] = cb_config
    model.generate_batch(prompts[:4], generation_config=GenerationConfig(max_new_tokens=4, do_sample=False,
                                                                          eos_token_id=-1), **kwargs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen, **kwargs)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    values = out.values() if isinstance(out, dict) else out
    generated = sum(len(getattr(o, "generated_tokens", []) or []) for o in values)
    return wall, generated


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=128)
    args = p.parse_args()
    print("transformers", transformers.__version__, "generate_batch", inspect.signature(LlamaForCausalLM.generate_batch),
          flush=True)
    model = None
    for attn in ("paged|sdpa", "sdpa_paged", "paged_attention"):
        try:
            model = build_model(attn)
            break
        except Exception as e:  # the paged attention name changed across versions
            print(f"attn_implementation {attn!r}: {type(e).__name__}: {e}", flush=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128256, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    configs = [("no cuda graph", None)]
    try:
        from transformers import ContinuousBatchingConfig

        configs = [("no cuda graph", ContinuousBatchingConfig(use_cuda_graph=False)),
                   ("cuda graph", ContinuousBatchingConfig(use_cuda_graph=True))]
    except ImportError as e:
        print("no ContinuousBatchingConfig:", e, flush=True)
    for name, cb in configs:
        try:
            wall, generated = run(model, prompts, args.gen_len, cb)
            print(json.dumps({"peer": "hf-transformers-cb", "variant": name, "requests": args.requests,
                              "prompt_len": args.prompt_len, "gen_len": args.gen_len, "wall_s": wall,
                              "generated": generated, "output_tokens_per_s": generated / wall}), flush=True)
        except Exception as e:
            print(json.dumps({"peer": "hf-transformers-cb", "variant": name, "error": f"{type(e).__name__}: {e}"}),
                  flush=True)


if __name__ == "__main__":
    main()
