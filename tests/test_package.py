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
