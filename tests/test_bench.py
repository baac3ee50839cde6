"""`glint bench demo` runs on the CPU (the numbers are only printed; the structure is checked)."""
import json

from glint.runtime.cli import main


def test_bench_demo_runs(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # No size flags: on a CPU the bench picks sizes that finish quickly (1,4 x 32 -> 8, 8 requests, widths to 128).
    assert main(["bench", "demo", "--length-spread", "0.5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [b["width"] for b in result["buckets"]] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert [(d["batch"], d["context"]) for d in result["decode"]] == [(1, 36), (4, 36)]
    assert all(d["device_ms"] > 0 and d["roofline_pct"] > 0 and d["engine_ms"] > 0 for d in result["decode"])
    e2e = result["end_to_end"]
    assert e2e["requests"] == 8 and e2e["length_spread"] == 0.5 and e2e["output_tokens_per_s"] > 0 and 0 < e2e["fraction_of_ceiling"]
    assert set(result["compile_s"]) == {str(w) for w in [1, 2, 4, 8, 16, 32, 64, 128]}
    assert "decode (one token per sequence)" in capsys.readouterr().out
