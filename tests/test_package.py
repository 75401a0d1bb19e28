"""The package face: its lazily imported names."""

from __future__ import annotations

from pathlib import Path

import pytest

import mlflow_hvd


def test_unknown_top_level_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="^module 'mlflow_hvd' has no attribute 'Nope'$"):
        _ = mlflow_hvd.Nope  # type: ignore[attr-defined]
    assert mlflow_hvd.HorovodRunner.__name__ == "HorovodRunner"
    assert "HorovodRunner" in dir(mlflow_hvd)


def _documented() -> str:
    """The README and the manual's pages."""
    from conftest import REPO

    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return "\n".join(p.read_text() for p in pages)


@pytest.mark.parametrize("module", ["mlflow_hvd", "mlflow_hvd.tracking", "mlflow_hvd.keras",
                                    "mlflow_hvd.torch", "mlflow_hvd.sweep"])
def test_every_public_name_is_documented_in_the_readme(module: str) -> None:
    import importlib
    import re

    face = importlib.import_module(module)
    names = getattr(face, "__all__", [])
    assert names, f"{module} declares no __all__"
    # what a face re-exports from Horovod is documented by Horovod
    names = [n for n in names if not (getattr(getattr(face, n), "__module__", None) or
                                      "").startswith("horovod.")]
    readme = _documented()
    missing = [n for n in names if not re.search(rf"`[\w.]*\b{re.escape(n)}\b", readme)]
    assert missing == [], f"{module}: not in the docs: {missing}"


def test_every_option_of_the_runner_is_documented_in_the_readme() -> None:
    import inspect

    readme = _documented()
    import dataclasses

    options = [n for n, p in inspect.signature(mlflow_hvd.HorovodRunner).parameters.items()
               if p.kind is not p.VAR_KEYWORD]
    for group in (mlflow_hvd.JobConfig, mlflow_hvd.ClusterConfig, mlflow_hvd.TrackingConfig):
        options += [f.name for f in dataclasses.fields(group)]
    missing = [n for n in options if f"| `{n}` |" not in readme]
    assert missing == [], f"HorovodRunner options not in the docs' table: {missing}"


def test_the_architecture_map_lists_every_module() -> None:
    from conftest import REPO

    readme = _documented()
    start = readme.index("```\nmlflow_hvd/\n")
    block = readme[start:readme.index("```\n", start + 4)]
    package = REPO / "mlflow_hvd"
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        folder = f"  {rel.parent}/" if rel.parent != Path(".") else ""
        if path.name == "__init__.py":
            if folder and folder not in block:  # a package: its own line
                missing.append(str(rel))
        elif path.name not in block:
            missing.append(str(rel))
    assert missing == [], f"modules not in the docs' architecture map: {missing}"
