"""runtime/weights.py reads back exactly what orbax wrote, however it was stored, and names what is wrong."""
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from glint.runtime.weights import read_params


def save(folder: pathlib.Path, params: dict, *, ocdbt: bool, compression: bool) -> pathlib.Path:
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_compression=compression)) as ckpt:
        ckpt.save(folder.absolute(), args=ocp.args.PyTreeSave(params))
    return folder


def random_params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    rows, cols = (int(n) for n in rng.integers(3, 40, size=2))
    return {"embed.embedding": jnp.asarray(rng.standard_normal((rows, cols)), jnp.bfloat16),
            "layers.0.attn.wqkv.kernel": jnp.asarray(rng.standard_normal((cols, 3 * cols)), jnp.bfloat16),
            "layers.0.norm.scale": jnp.asarray(rng.standard_normal(cols), jnp.float32),
            "positions": jnp.asarray(rng.integers(-1000, 1000, size=(rows,)), jnp.int32)}


def like(params: dict) -> dict:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params.items()}


@pytest.mark.parametrize("ocdbt", [True, False])
@pytest.mark.parametrize("compression", [True, False])
def test_every_storage_reads_back_exactly(tmp_path, ocdbt, compression):
    params = random_params(seed=int(ocdbt) * 2 + int(compression))
    folder = save(tmp_path / "params", params, ocdbt=ocdbt, compression=compression)
    device = jax.devices()[0]
    got = read_params(folder, like(params), device)
    assert list(got) == list(params)
    for name, want in params.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert got[name].devices() == {device}
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want), err_msg=name)


@pytest.mark.parametrize("read_ahead", [1, 200, None])  # one array at a time, a few, the default (all of them)
def test_reads_ahead_of_a_device_still_starting(tmp_path, read_ahead):
    """The device as start_device()'s future, the reads bounded by a host-memory budget smaller than the
    arrays: the same arrays, on that device."""
    from glint.runtime.weights import start_device

    params = random_params(seed=9)
    folder = save(tmp_path / "params", params, ocdbt=False, compression=False)
    got = read_params(folder, like(params), start_device(), num_threads=3, read_ahead_bytes=read_ahead)
    assert list(got) == list(params)
    for name, want in params.items():
        assert got[name].devices() == {jax.devices()[0]}
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want), err_msg=name)


def test_arrays_stored_in_another_dtype_are_cast(tmp_path):
    stored = {"w": jnp.asarray(np.random.default_rng(5).standard_normal((7, 5)), jnp.float32)}
    folder = save(tmp_path / "params", stored, ocdbt=True, compression=True)
    got = read_params(folder, {"w": jax.ShapeDtypeStruct((7, 5), jnp.bfloat16)})
    assert got["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(stored["w"].astype(jnp.bfloat16)))


def test_missing_unexpected_and_misshaped_arrays_are_named(tmp_path):
    params = random_params(seed=9)
    folder = save(tmp_path / "params", params, ocdbt=False, compression=False)
    fewer = {k: v for k, v in like(params).items() if k != "positions"}
    with pytest.raises(ValueError, match=r"do not match the model: missing \[\], unexpected \['positions'\]"):
        read_params(folder, fewer)
    more = dict(like(params), extra=jax.ShapeDtypeStruct((2,), jnp.float32))
    with pytest.raises(ValueError, match=r"missing \['extra'\], unexpected \[\]"):
        read_params(folder, more)
    shape = params["embed.embedding"].shape
    wrong = dict(like(params), **{"embed.embedding": jax.ShapeDtypeStruct((shape[0] + 1, shape[1]), jnp.bfloat16)})
    with pytest.raises(ValueError, match=rf"'embed.embedding' is stored with shape \({shape[0]}, {shape[1]}\), "
                                         rf"the model expects \({shape[0] + 1}, {shape[1]}\)"):
        read_params(folder, wrong)


@pytest.mark.parametrize("ocdbt", [True, False])
def test_damaged_files_are_clear_errors(tmp_path, ocdbt):
    params = random_params(seed=11)
    folder = save(tmp_path / "params", params, ocdbt=ocdbt, compression=False)
    for f in folder.rglob("*"):
        if f.is_file() and f.stat().st_size > 200 and f.name != "_METADATA":
            f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"params: the weights could not be read: array '"):
        read_params(folder, like(params))
    (folder / "_METADATA").write_text("{not json")
    with pytest.raises(ValueError, match=r"params: the weights could not be read: _METADATA is not orbax"):
        read_params(folder, like(params))
    (folder / "_METADATA").unlink()
    with pytest.raises(ValueError, match=r"params: the weights could not be read: _METADATA is missing"):
        read_params(folder, like(params))


def test_what_other_orbax_writers_leave(tmp_path, monkeypatch):
    """Nested trees (names joined by dots), _METADATA without use_ocdbt, and chunks left out because they equal
    the fill value (zarr3 writers that skip them): read as orbax reads them."""
    import json

    from orbax.checkpoint._src.serialization import tensorstore_utils

    rng = np.random.default_rng(13)
    nested = {"layers": {"0": {"w": jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)}},
              "bias": jnp.zeros((5,), jnp.float32)}
    flat = {"layers.0.w": nested["layers"]["0"]["w"], "bias": nested["bias"]}
    for ocdbt in (True, False):
        folder = save(tmp_path / f"nested{ocdbt}", nested, ocdbt=ocdbt, compression=False)
        meta = json.loads((folder / "_METADATA").read_text())
        del meta["use_ocdbt"]
        (folder / "_METADATA").write_text(json.dumps(meta))
        got = read_params(folder, like(flat))
        for name, want in flat.items():
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want))
    monkeypatch.setattr(tensorstore_utils, "STORE_ARRAY_DATA_EQUAL_TO_FILL_VALUE", False)
    folder = tmp_path / "sparse"
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True)) as ckpt:
        ckpt.save(folder.absolute(), args=ocp.args.PyTreeSave(flat))
    got = read_params(folder, like(flat))
    np.testing.assert_array_equal(np.asarray(got["bias"]), np.zeros(5, np.float32))
    np.testing.assert_array_equal(np.asarray(got["layers.0.w"]), np.asarray(flat["layers.0.w"]))
