"""Shared test fixtures: the HF reference checkpoints beside the repo (or GLINT_HF_FIXTURES)."""
import os
import pathlib
import tempfile

# `make test-gpu` sets GLINT_TEST_GPU=1: the kernel, model and engine tests then compile the Pallas kernels for the
# GPU (attention="pallas", interpret=False) where they otherwise run them in the Pallas interpreter on the CPU.
ON_GPU = os.environ.get("GLINT_TEST_GPU") == "1"
INTERPRET = not ON_GPU
PALLAS = "pallas" if ON_GPU else "interpret"
if not ON_GPU:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Pallas' GPU interpreter runs each warpgroup of a CTA on a thread whose program the CPU client runs on its
    # thread pool, sized by the cores: on a 2-core machine the Mosaic prefill kernel's three warpgroups starve it
    # (one never runs while the others wait for it at a barrier), so the pool gets at least four threads.
    os.environ.setdefault("PJRT_NPROC", str(max(4, os.cpu_count() or 1)))
    # Four CPU devices, for the tensor-parallel tests (tests/test_tp.py); everything else runs on the first.
    TP_DEVICES = 4
    # The suite's programs are tiny and compiled once or twice each: compiling is most of its time, so LLVM's
    # optimisation passes are skipped (XLA's own HLO passes, which decide what is computed, still run; on the
    # 2-core CI machine this takes about a quarter off the suite).
    for flag in (f"--xla_force_host_platform_device_count={TP_DEVICES}", "--xla_backend_optimization_level=0",
                 "--xla_llvm_disable_expensive_passes=true"):
        if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
# Each test run compiles into a fresh persistent cache of its own (never the user's ~/.cache/glint), one that its
# xdist workers share: a program one worker compiled, the other loads (JAX locks the cache's files).
# No size limit: with one, JAX scans every entry under a lock for each one it adds (quadratic in a test run).
os.environ["GLINT_CACHE_MAX_BYTES"] = "-1"
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _run:
    os.environ["GLINT_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"glint-test-cache-{_run}")
    os.makedirs(os.environ["GLINT_CACHE_DIR"], exist_ok=True)
else:
    os.environ["GLINT_CACHE_DIR"] = tempfile.mkdtemp(prefix="glint-test-cache-")

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
HF_FIXTURES = pathlib.Path(os.environ.get("GLINT_HF_FIXTURES", SHARED / "fixtures" / "hf"))
STORIES = pathlib.Path(os.environ.get("GLINT_STORIES", SHARED / "models" / "stories260K"))


def fixture_dirs() -> list[pathlib.Path]:
    if not HF_FIXTURES.is_dir():
        return []
    return sorted(p for p in HF_FIXTURES.iterdir() if (p / "config.json").exists())


def covering_fixtures() -> list[pathlib.Path]:
    """For machinery that does not depend on the architecture (export, serving): the first fixture with
    sliding-window (ring) layers and the first without, which is what changes the cache geometry."""
    from glint.model.config import ModelConfig

    dirs = fixture_dirs()
    ring = {p: any(ModelConfig.from_hf(p).layer_windows) for p in dirs}
    return [p for p in dirs if ring[p]][:1] + [p for p in dirs if not ring[p]][:1]


def fail_launch(engine, call: int, message: str) -> None:
    """Make the engine's `call`-th forward launch raise RuntimeError(message), as a device failing would."""
    real, calls = engine.runner.run_forward, [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError(message)
        return real(*args, **kwargs)

    engine.runner.run_forward = failing


def stop_piece(text: str) -> str | None:
    """A 2-character piece of `text` past its start, of whole visible characters (None: none): a stop string."""
    return next((text[i:i + 2] for i in range(4, len(text) - 2)
                 if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip()), None)


def pytest_generate_tests(metafunc):
    if "hf_fixture" in metafunc.fixturenames:
        dirs = fixture_dirs()
        if not dirs:
            raise pytest.UsageError(f"no HF fixtures found in {HF_FIXTURES} (set GLINT_HF_FIXTURES)")
        metafunc.parametrize("hf_fixture", dirs, ids=[p.name for p in dirs])


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """Convert each fixture once per session (float32) and return the orbax folder."""
    from glint.export.checkpoint import convert

    cache: dict[pathlib.Path, pathlib.Path] = {}

    def get(hf_dir: pathlib.Path) -> pathlib.Path:
        if hf_dir not in cache:
            out = tmp_path_factory.mktemp(hf_dir.name)
            convert(hf_dir, out, dtype="float32", show_progress=False)
            cache[hf_dir] = out
        return cache[hf_dir]

    return get
