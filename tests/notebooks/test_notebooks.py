"""Every notebook in notebooks/ runs top to bottom against the embedded broker.

The code cells are executed in order in a fresh Python process (one namespace, as a kernel would), so a
notebook that no longer matches the code fails here rather than in front of a user. No Jupyter needed.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))

RUNNER = """
import json, sys
ns = {"__name__": "__main__"}
for i, cell in enumerate(json.load(open(sys.argv[1]))["cells"]):
    if cell["cell_type"] == "code":
        source = "".join(cell["source"])
        try:
            exec(compile(source, f"{sys.argv[1]} cell {i}", "exec"), ns)
        except Exception:
            print(f"cell {i} failed:\\n{source}", file=sys.stderr)
            raise
print("NOTEBOOK OK")
"""


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(notebook):
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(notebook)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "NOTEBOOK OK" in proc.stdout, proc.stderr[-4000:]
