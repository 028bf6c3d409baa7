"""The Colab quickstart runs top to bottom on CPU (reduced setting)."""

import json
import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).parent.parent


def test_quickstart_notebook_runs(monkeypatch):
  monkeypatch.setenv("DART_JAX_NOTEBOOK_SMOKE", "1")
  nb = nbformat.read(ROOT / "notebooks" / "colab_tpu_quickstart.ipynb", as_version=4)
  client = NotebookClient(nb, timeout=900, kernel_name="python3",
                          resources={"metadata": {"path": str(ROOT)}})
  client.execute()
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
  assert "mean acceptance length" in outputs and "speedup per prompt" in outputs


def test_quickstart_notebook_cells_have_unique_ids():
  # nbformat >= 4.5 requires an id per cell; nbformat.read adds missing ones
  # with a warning that a later release turns into an error, so read the file.
  raw = json.loads((ROOT / "notebooks" / "colab_tpu_quickstart.ipynb").read_text())
  ids = [cell.get("id") for cell in raw["cells"]]
  assert None not in ids and len(set(ids)) == len(ids)
  nbformat.validate(nbformat.from_dict(raw))
