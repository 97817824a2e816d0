"""The public API re-exported from megatron_mech is exactly the functions of the small modules."""
import subprocess
import sys

import megatron_mech
from megatron_mech.core import detect, layouts, router, snr, spectral


def test_public_names_resolve_to_their_modules():
    modules = {"detect": detect, "layouts": layouts, "router": router, "snr": snr, "spectral": spectral}
    for name in megatron_mech.__all__:
        obj = getattr(megatron_mech, name)
        assert any(getattr(m, name, None) is obj for m in modules.values()), name


def test_import_is_light():
    code = "import sys, megatron_mech; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


FRAMEWORKS = ("megatron", "deepspeed", "transformers")


def test_core_imports_no_framework():
    """The framework-free core stays framework-free: no module in megatron_mech/core/ imports megatron,
    deepspeed or transformers, neither in its source (any import statement, also inside functions) nor when
    every core module is imported in a fresh interpreter."""
    import ast
    from pathlib import Path

    core = Path(megatron_mech.__file__).parent / "core"
    modules = sorted(p for p in core.glob("*.py"))
    assert len(modules) >= 10  # spectral, layouts, sharded, slq, router, snr, detect, taxonomy, attribution, mols
    offenders = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FRAMEWORKS]
    assert not offenders, offenders
    code = ("import importlib, sys; from pathlib import Path; import megatron_mech.core as c; "
            "[importlib.import_module('megatron_mech.core.' + p.stem) for p in Path(c.__file__).parent.glob('*.py') "
            "if p.stem != '__init__']; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({FRAMEWORKS!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
