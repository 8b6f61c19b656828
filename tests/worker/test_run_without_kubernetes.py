"""`rljob run` needs no Kubernetes client unless it publishes (--publish): the GPU machines
and a laptop may have none. A run whose status code imported the client (rljob_worker.publish)
failed there before its first rank started (ModuleNotFoundError: kubernetes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_rljob_run_runs_with_no_kubernetes_client_importable(tmp_path: Path) -> None:
    doc = yaml.safe_load((REPO / "examples" / "tiny-local.yaml").read_text())
    doc["spec"]["algorithm"]["iterations"] = 2
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"
    # None in sys.modules makes `import kubernetes` raise ModuleNotFoundError in the driver's
    # process (the rank processes it spawns start without it, and import no client anyway).
    code = (
        "import sys; sys.modules['kubernetes'] = None\n"
        "from rljob_worker.cli_run import main\n"
        f"sys.exit(main([{str(manifest)!r}, '--out', {str(out)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "Succeeded" and status["iteration"] == 2
