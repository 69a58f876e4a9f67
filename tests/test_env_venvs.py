"""The venvs the buffer makes from a requirement list (rollout_buffer/environments/venvs.py), made by uv."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rollout_buffer.environments.venvs import venv_python

CERT_VARIABLES = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "NIX_SSL_CERT_FILE")


def test_a_venv_is_made_once_trusting_the_systems_certificates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    # Only the system's certificate store to trust (as pip has it from pip.conf, or truststore): behind a proxy
    # whose CA is installed there, the index is still reached.
    for name in CERT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ROLLOUT_BUFFER_ENV_VENVS", str(tmp_path / "venvs"))
    monkeypatch.setenv("UV_NO_CACHE", "1")
    python = venv_python(["six==1.17.0"], "env_requirements")
    done = subprocess.run([python, "-c", "import six, sys; print(six.__version__, sys.prefix)"], capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.split() == ["1.17.0", str(Path(python).parent.parent)]
    assert venv_python(["six==1.17.0 "], "env_requirements") == python, "the same list: the same venv, kept"
    with pytest.raises(ValueError, match="env_requirements: uv could not install"):
        venv_python(["rollout-buffer-no-such-package==0.0.1"], "env_requirements")
