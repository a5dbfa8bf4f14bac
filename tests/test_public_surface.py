"""The public surface: every exported name resolves, and the spec layer never imports torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import ModuleType

import pytest

import shardwise
import shardwise.sharding


@pytest.mark.parametrize("module", [shardwise, shardwise.sharding], ids=lambda m: m.__name__)
def test_all_names_resolve(module: ModuleType) -> None:
    assert module.__all__, module.__name__
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []


@pytest.mark.parametrize("module", [shardwise, shardwise.sharding], ids=lambda m: m.__name__)
def test_all_has_no_duplicates(module: ModuleType) -> None:
    names = list(module.__all__)
    assert all(isinstance(n, str) for n in names)
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_spec_names_are_re_exported_at_top_level() -> None:
    for name in (
        "DeviceMesh",
        "Replicated",
        "Sharded",
        "Partial",
        "ReduceOp",
        "PlacementMapping",
        "NamedMapping",
        "DimSpec",
        "ShardingSpec",
        "ShardingError",
        "ConversionError",
        "CPU",
        "Accelerator",
    ):
        assert name in shardwise.__all__
    assert shardwise.DeviceMesh is shardwise.sharding.DeviceMesh
    assert shardwise.ConversionError is shardwise.sharding.ConversionError


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        shardwise.no_such_name  # noqa: B018


def test_error_family() -> None:
    from shardwise.sharding import ConversionError, ShardingError

    assert issubclass(ShardingError, ValueError)
    assert issubclass(ConversionError, ShardingError)
    assert issubclass(shardwise.DeviceError, ShardingError)


@pytest.mark.parametrize("module", ["shardwise.sharding", "shardwise"])
def test_import_does_not_import_torch(module: str) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        import {module}
        from shardwise.sharding import DeviceMesh, NamedMapping, local_shard_shape_from_global
        mesh = DeviceMesh.cpu((2, 2), ("dp", "tp"))
        NamedMapping(mesh, ("tp",)).to_placements()
        local_shard_shape_from_global((5,), mesh, NamedMapping(mesh, ("tp",)).to_placements())
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print("TORCH_MODULES", loaded)
        sys.exit(1 if loaded else 0)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TORCH_MODULES []" in result.stdout


def test_submodules_are_attributes_of_a_bare_import() -> None:
    """``import shardwise`` alone reaches ``shardwise.distributed``, ``.lax`` and ``.debug``
    (resolved on first access: the import itself stays torch-free)."""
    code = textwrap.dedent(
        """
        import sys
        import shardwise
        assert "torch" not in sys.modules
        assert callable(shardwise.distributed.initialize)
        assert callable(shardwise.debug.CommCounter) and callable(shardwise.debug.visualize)
        print("TORCH_AFTER_DISTRIBUTED_DEBUG", "torch" in sys.modules)
        assert callable(shardwise.lax.psum)
        assert shardwise.lax is sys.modules["shardwise.lax"]
        assert shardwise.distributed is sys.modules["shardwise.distributed"]
        assert shardwise.debug is sys.modules["shardwise.debug"]
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TORCH_AFTER_DISTRIBUTED_DEBUG False" in result.stdout
