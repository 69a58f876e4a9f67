"""The documentation: README's curl tour runs as written (pasted as one bash block), and the MkDocs site builds."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from servers import free_port

ROOT = Path(__file__).resolve().parent.parent
# The markers are pymdownx.snippets' section markers too: docs/index.md includes the same block.
TOUR_START = "<!-- --8<-- [start:tour] -->"
TOUR_END = "<!-- --8<-- [end:tour] -->"


def tour_block() -> str:
    readme = (ROOT / "README.md").read_text()
    assert TOUR_START in readme and TOUR_END in readme, "README's curl tour lost its markers"
    section = readme.split(TOUR_START, 1)[1].split(TOUR_END, 1)[0]
    blocks = re.findall(r"^```bash\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, "the tour is one bash block between its markers"
    return blocks[0]


def port_is_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_curl_tour_runs_as_written(tmp_path: Path) -> None:
    block = tour_block()
    assert "--host" not in block, "the tour's servers stay on 127.0.0.1 (the default)"
    script = tmp_path / "tour.sh"
    script.write_text(block)
    port, engine_port = free_port(), free_port()
    env = {
        **os.environ,
        "PORT": str(port),
        "ENGINE_PORT": str(engine_port),
        "TMPDIR": str(tmp_path),  # the tour's mktemp -d (logs, store, batch.json) lands here
        # `rollout-buffer` and `python` are this interpreter's
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    proc = subprocess.Popen(["bash", "-euo", "pipefail", str(script)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the tour did not finish in 240 s\nstdout:\n{out}\nstderr:\n{err}")
    finally:
        # The tour stops its servers itself (checked below); anything left of its process group goes now.
        still_open = [p for p in (port, engine_port) if port_is_open(p)]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in tmp_path.glob("*/*.log"))
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{err}\n{logs}"
    answers = []
    for line in out.splitlines():
        try:
            answers.append(json.loads(line))
        except ValueError:
            continue
    assert {"success": True, "acked_groups": 1} in answers, f"no successful ack in the tour's output:\n{out}"
    assert any(a.get("success") and a.get("run_id") for a in answers if isinstance(a, dict)), out
    assert re.search(r"^rollout_buffer_groups_acked_total 1\.0$", out, re.MULTILINE), out
    assert not still_open, f"the tour left servers on ports {still_open}"


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    for module in ("mkdocs", "material"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]')")
    # Not -q: it hides the warnings that --strict turns into a failure (a broken link would pass).
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=240, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()
    # The quick start includes README's tour (pymdownx.snippets): it is there, not the include line.
    index = (tmp_path / "site" / "index.html").read_text()
    assert "get_rollout_data" in index and "--8&lt;--" not in index and "--8<--" not in index
