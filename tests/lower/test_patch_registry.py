"""The lowering's patches (lower/inductor.py): each one in shape_patches.py or codegen_patches.py
says which torch it was written for, and each is entered where dpfx lowers or captures."""
import inspect

from dpfx.lower import codegen_patches, inductor, shape_patches


def _patches(module) -> set[str]:
    """The context managers a module defines (``@contextlib.contextmanager`` functions)."""
    return {name for name, f in vars(module).items() if inspect.isfunction(f)
            and f.__module__ == module.__name__ and hasattr(f, "__wrapped__")}


def test_each_patch_names_its_torch_and_is_entered():
    assert _patches(shape_patches) == set(shape_patches.TORCH_VERSIONS)
    assert _patches(codegen_patches) == set(codegen_patches.TORCH_VERSIONS)
    entered = {cm.gen.__name__
               for cm in inductor.shape_patch_list(None) + inductor.codegen_patch_list()}
    assert set(shape_patches.TORCH_VERSIONS) <= entered
    # optimization_hints_once is entered around the whole capture (backend/__init__.py), the
    # rest here
    assert set(codegen_patches.TORCH_VERSIONS) - entered == {"optimization_hints_once"}
    import dpfx.backend
    assert dpfx.backend.optimization_hints_once is codegen_patches.optimization_hints_once
