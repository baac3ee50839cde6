"""CacheConfig: validation, layer groups, ring geometry and the memory budget."""

from __future__ import annotations

import pytest

from test_kvcache_control import make_config

from glint.kvcache import CacheConfig


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(page_size=0), "page_size = 0"),
        (dict(num_pages=1), "num_pages = 1"),
        (dict(windows=(0, -2)), r"windows\[1\] = -2"),
        (dict(windows=()), "windows is empty"),
        (dict(kv_heads=(2, 2, 2)), "kv_heads has 3 entries"),
        (dict(head_dim=(8, 0, 8, 8)), r"head_dim\[1\] = 0"),
        (dict(dtype="float64"), "dtype = 'float64'"),
        (dict(page_size=1 << 20, num_pages=1 << 12), "int32 slot limit"),
    ],
)
def test_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_config(**overrides)


def test_config_groups_and_budget():
    cfg = make_config(windows=(8, 0, 4, 8, 0), kv_heads=(1, 2, 1, 1, 2), head_dim=16, max_write=8, capacity=64)
    assert cfg.group_windows == (0, 4, 8)
    assert cfg.layer_group == (2, 0, 1, 2, 0)
    assert cfg.head_dim == (16,) * 5
    assert [cfg.group_ring_rows(g) for g in range(3)] == [None, 11, 15]
    assert [cfg.group_rows(g) for g in range(3)] == [64, 11, 15]
    assert [cfg.group_pages_per_seq(g) for g in range(3)] == [16, 3, 4]
    assert cfg.page_bytes(1) == 2 * 4 * 2 * 16 * 2
    per_id = sum(cfg.page_bytes(layer) for layer in range(5))
    assert cfg.num_pages_for_budget(10 * per_id + per_id - 1) == 10
    assert cfg.num_pages_for_budget(10**12) == cfg.max_useful_pages == 1 + 4 * 16
    built = CacheConfig.from_budget(
        7 * per_id, page_size=4, max_seqs=4, max_write=8, capacity=64,
        windows=(8, 0, 4, 8, 0), kv_heads=(1, 2, 1, 1, 2), head_dim=16,
    )
    assert built.num_pages == 7
    with pytest.raises(ValueError, match="need at least 2"):
        cfg.num_pages_for_budget(per_id)
    assert make_config(capacity=5, windows=(8,)).group_ring_rows(0) == 5


def test_host_files_do_not_import_jax():
    import ast
    import pathlib

    import glint.kvcache

    root = pathlib.Path(glint.kvcache.__file__).parent
    for name in ("config.py", "control.py"):
        tree = ast.parse((root / name).read_text())
        modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in modules if m.split(".")[0] in ("jax", "jaxlib", "flax")], (name, modules)


def test_config_is_frozen_and_hashable():
    import dataclasses

    cfg = make_config()
    assert hash(cfg) == hash(make_config(kv_heads=(2, 2, 2, 2)))  # ints normalise to tuples
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 8
    with pytest.raises(ValueError, match="from_budget chooses it"):
        CacheConfig.from_budget(1 << 20, num_pages=4, page_size=4, max_seqs=1, max_write=1, capacity=8,
                                windows=(0,), kv_heads=1, head_dim=8)
