"""W&B online without an API key is found before anything is built (``wandb_login_problem``), looking where W&B
itself finds a key, without asking its server: nothing here needs the network."""
from __future__ import annotations

import pytest

from megatron_mech.records.sinks import wandb_login_problem


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """A home without .netrc or W&B settings, and no W&B variable set."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL",
                 "WANDB_CONFIG_DIR", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_online_without_a_key_is_named(no_credentials, monkeypatch):
    assert wandb_login_problem() == ("W&B would log online (WANDB_MODE=unset) but no API key is set up for "
                                     "api.wandb.ai: set WANDB_API_KEY, run 'wandb login', or set WANDB_MODE=offline")
    monkeypatch.setenv("WANDB_MODE", "online")
    assert "(WANDB_MODE=online)" in wandb_login_problem()


@pytest.mark.parametrize("mode", ["offline", "dryrun", "disabled"])
def test_offline_modes_need_no_key(no_credentials, monkeypatch, mode):
    monkeypatch.setenv("WANDB_MODE", mode)
    assert wandb_login_problem() is None


def test_a_key_where_wandb_finds_one_is_enough(no_credentials, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_login_problem() is None
    monkeypatch.delenv("WANDB_API_KEY")
    # what `wandb login` writes: a .netrc entry for the server's host
    (no_credentials / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")
    (no_credentials / ".netrc").chmod(0o600)
    assert wandb_login_problem() is None
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")  # another server: that entry is not its key
    assert "no API key is set up for wandb.example.org" in wandb_login_problem()
    (no_credentials / ".config" / "wandb").mkdir(parents=True)
    (no_credentials / ".config" / "wandb" / "settings").write_text("[default]\napi_key = " + "k" * 40 + "\n")
    assert wandb_login_problem() is None
