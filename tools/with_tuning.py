"""Run a script or module with pallas_kernels/tuning.py values set in this process first, to compare settings one
process each (the executables cache keys on tuning's values, so arms never share compiled programs):

    TUNING="FP8_GATED_KERNEL=1,GATED_FP8_ROWS=16" python3 tools/with_tuning.py tools/gpu_step_profile.py OUT ...
    TUNING=TARGET_PROGRAMS=256 python3 tools/with_tuning.py -m glint.runtime.cli bench llama3-8b ...

Each value takes the type of the one it replaces (booleans: 0/1 or false/true). A dict constant's entry is
NAME.KEY (`TUNING=MOSAIC_DECODE.block_kv=64,MOSAIC_DECODE.num_stages=4`).
"""
import os
import runpy
import sys

from glint.pallas_kernels import tuning


def _typed(name: str, old, value: str):
    """`value` in the type of `old`."""
    if isinstance(old, bool):  # bool("0") is True
        if value.lower() not in ("0", "1", "false", "true"):
            raise SystemExit(f"with_tuning: {name} takes 0/1 or false/true, not {value!r}")
        return value.lower() in ("1", "true")
    return type(old)(value)


def apply(spec: str) -> None:
    for item in filter(None, spec.split(",")):
        target, _, value = item.partition("=")
        name, _, key = target.partition(".")
        if not name.isupper() or not hasattr(tuning, name):
            raise SystemExit(f"with_tuning: {name!r} is not a pallas_kernels.tuning constant")
        old = getattr(tuning, name)
        if key:
            if not isinstance(old, dict) or key not in old:
                raise SystemExit(f"with_tuning: tuning.{name} has no entry {key!r}")
            setattr(tuning, name, {**old, key: _typed(target, old[key], value)})
        else:
            setattr(tuning, name, _typed(name, old, value))
        print(f"tuning.{name} = {getattr(tuning, name)!r} (was {old!r})", flush=True)


if __name__ == "__main__":
    apply(os.environ.get("TUNING", ""))
    if sys.argv[1:2] == ["-m"]:
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
