"""Every notebook in notebooks/ runs top to bottom against the embedded broker, as Jupyter runs it.

Each notebook is executed by nbclient in a real Python kernel whose working directory is the notebook's
own folder (what Jupyter does), so a notebook that only works from the repository root, or no longer
matches the code, fails here rather than in front of a user. Outputs are not written back.
"""

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


def test_the_source_is_discovered_outside_the_repository(tmp_path):
    """PySpark finds Python data sources by scanning sys.path for `pyspark_*` modules: the README's install
    commands must make `pyspark_amqp` visible from any directory, not only from the checkout."""
    proc = subprocess.run([sys.executable, "-c", "import pkgutil; print(sorted(m.name for m in "
                           "pkgutil.iter_modules() if m.name.startswith('pyspark_')))"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "pyspark_amqp" in proc.stdout, (proc.stdout, proc.stderr)


@pytest.mark.own_spark
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(notebook):
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(notebook.parent)}})
    client.execute()   # raises CellExecutionError naming the cell and its traceback
