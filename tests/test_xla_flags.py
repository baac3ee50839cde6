"""glint's XLA_FLAGS defaults: added once, never over a flag the user set, never after a backend started."""
import sys
import types

import jax

from glint.runtime import xla_flags


def test_merged_adds_each_default_once_and_keeps_the_users_value():
    defaults = {"xla_a": "X", "xla_b": "Y"}
    assert xla_flags.merged("", defaults) == "--xla_a=X --xla_b=Y"
    assert xla_flags.merged("--xla_b=mine --xla_c=1", defaults) == "--xla_b=mine --xla_c=1 --xla_a=X"
    assert xla_flags.merged(xla_flags.merged("", defaults), defaults) == "--xla_a=X --xla_b=Y"


def test_apply_before_a_backend_starts(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax._src.xla_bridge", types.SimpleNamespace(backends_are_initialized=lambda: False))
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    xla_flags.apply(env)
    for name, value in xla_flags.DEFAULTS.items():
        assert f"--{name}={value}" in env["XLA_FLAGS"].split()
    assert env["XLA_FLAGS"].startswith("--xla_force_host_platform_device_count=2 ")
    off = {"GLINT_XLA_DEFAULTS": "0"}
    xla_flags.apply(off)
    assert "XLA_FLAGS" not in off


def test_apply_after_a_backend_started_changes_nothing(caplog):
    jax.devices()  # this process's backend is up
    env = {}
    xla_flags.apply(env)
    assert env == {}
    assert "do not apply" in caplog.text
