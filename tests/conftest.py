import os

import pytest

# Distributed tests spawn their own processes; keep each one from oversubscribing the 2 CI cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def installed_package(tmp_path_factory):
    """This checkout as sdist → wheel, installed into a fresh virtual environment outside it (once per session)."""
    from installed_package import build_and_install

    return build_and_install(tmp_path_factory.mktemp("installed_package"))
