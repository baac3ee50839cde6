"""GPU check of speculative decoding through the Pallas kernels (float32): the oracle drafter, wrong at known
places, on every HF fixture against transformers' greedy tokens and the acceptance greedy verification
defines; prompt lookup on stories260K against llama2.c's tokens; the DFlash fixture against z-lab's outputs.

  python tools/gpu_spec.py FIXTURES_DIR STORIES_DIR DFLASH_DIR [--no-fixtures]
"""
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from test_spec import expected_acceptance, perturbed  # noqa: E402

from glint.runtime.engine import Engine  # noqa: E402
from glint.runtime.params import SamplingParams  # noqa: E402

SMALL = dict(max_seqs=8, page_size=16, max_step_tokens=256, num_pages=256, capacity=512, attention="pallas")


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def main():
    fixtures, stories, dflash = (pathlib.Path(a) for a in sys.argv[1:4])
    rows = []
    for d in [] if "--no-fixtures" in sys.argv else sorted(p for p in fixtures.iterdir() if (p / "config.json").exists()):
        cases = json.loads((d / "reference.json").read_text())["cases"]
        vocab = json.loads((d / "config.json").read_text())["vocab_size"]
        for k in (3, 7):
            t0 = time.perf_counter()
            engine = Engine.from_pretrained(str(d), dtype="float32", draft="oracle", num_speculative_tokens=k,
                                            **dict(SMALL, max_prefill_chunk=16, min_prefill_chunk=8))
            proposals = [perturbed(c["greedy"], vocab, every=3 + i % 3, salt=i) for i, c in enumerate(cases)]
            for c, p in zip(cases, proposals):
                engine.drafter.record(c["prompt"], p)
            outs = engine.generate([c["prompt"] for c in cases], greedy(len(cases[0]["greedy"])))
            sure = [(o, c, p) for o, c, p in zip(outs, cases, proposals) if c["greedy_min_gap"] >= 1e-3]
            rows.append((f"{d.name} oracle k={k}", all(o.token_ids == c["greedy"] for o, c, _ in sure),
                         all(o.acceptance_lengths == expected_acceptance(c["greedy"], p, k) for o, c, p in sure),
                         engine.stats.mean_acceptance_length, time.perf_counter() - t0))
            print(rows[-1], flush=True)
    case = json.loads((stories / "reference.json").read_text())["cases"][0]
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(str(stories), draft="ngram", num_speculative_tokens=4, **SMALL)
    out = engine.generate([case["prompt"]], greedy(len(case["greedy"])))[0]
    rows.append(("stories260K ngram k=4", out.token_ids == case["greedy"], None, engine.stats.mean_acceptance_length,
                 time.perf_counter() - t0))
    print(rows[-1], flush=True)
    ref = json.loads((dflash / "reference.json").read_text())
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(str(dflash / "target"), draft=str(dflash / "draft"), **SMALL)
    outs = engine.generate([c["prompt"] for c in ref["cases"]], greedy(ref["max_new_tokens"]))
    rows.append(("dflash fixture", all(o.token_ids == c["output_ids"] for o, c in zip(outs, ref["cases"])),
                 all(o.acceptance_lengths == c["acceptance_lengths"][:-1] for o, c in zip(outs, ref["cases"])),
                 engine.stats.mean_acceptance_length, time.perf_counter() - t0))
    print(rows[-1], flush=True)
    print("\ncheck | tokens == reference | acceptance == reference | mean acceptance | s")
    for r in rows:
        print(" | ".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in r))
    return 0 if all(r[1] and r[2] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
