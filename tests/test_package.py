"""The package face: its lazily imported names."""

from __future__ import annotations

import importlib
import re
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


def _resolve(dotted: str) -> object:
    """The object a dotted name relative to ``mlflow_hvd`` names (modules imported as
    needed); AttributeError/ImportError when there is none."""
    import importlib

    parts = dotted.removeprefix("mlflow_hvd.").split(".") if dotted != "mlflow_hvd" else []
    obj: object = mlflow_hvd
    path = "mlflow_hvd"
    for part in parts:
        path = f"{path}.{part}"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(path)
    return obj


def test_the_api_reference_names_only_what_exists() -> None:
    """Every name in the reference's table resolves (a bare name after a dotted one in the
    same cell is in the same module; a bare first name is a top-level name), each argument
    it shows in parentheses is a parameter of it (``space_from_json(text)`` named one that
    is not), and every ``:::`` directive and each member it lists exists (mkdocstrings
    skips a missing member without a word)."""
    import inspect
    import re

    from conftest import REPO

    text = (REPO / "docs" / "api.md").read_text()
    missing = []
    for row in re.findall(r"^\| (.+?) \| (?:driver|rank|rank 0|both) \|", text, re.M):
        shown = re.findall(r"`([^`]+)`", row)
        names = [re.sub(r"\(.*", "", n) for n in shown]
        prefix = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
        for name, call in zip(names, shown, strict=True):
            if name.endswith(".*"):
                name = name[:-2]
            elif "." not in name and prefix:
                name = f"{prefix}.{name}"
            try:
                obj = _resolve(name)
            except (AttributeError, ImportError):
                missing.append(name)
                continue
            given = re.fullmatch(r"[^(]*\((.*)\)", call)
            if given is None:
                continue
            params = inspect.signature(obj).parameters
            for arg in re.split(r",\s*", given.group(1)):
                arg = arg.split("=")[0].strip()
                if arg and arg != "..." and not arg.startswith("*") and arg not in params:
                    missing.append(f"{call}: no parameter {arg!r}")
    for target, options in re.findall(r"^::: (\S+)\n((?:    .*\n)*)", text, re.M):
        try:
            obj = _resolve(target)
        except (AttributeError, ImportError):
            missing.append(target)
            continue
        listed = re.search(r"members: \[([^\]]*)\]", options)
        for member in re.split(r"[,\s]+", listed.group(1).strip()) if listed else []:
            if not hasattr(obj, member):
                missing.append(f"{target}.{member}")
    assert missing == [], f"docs/api.md names what does not exist: {missing}"


def test_every_error_class_has_its_troubleshooting_entry() -> None:
    import inspect

    from conftest import REPO

    import mlflow_hvd.errors as errors

    page = (REPO / "docs" / "troubleshooting.md").read_text()
    classes = [name for name, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, BaseException)
               and obj.__module__ == errors.__name__]
    assert len(classes) >= 19
    missing = [name for name in classes if f"\n### {name}\n" not in page]
    assert missing == [], f"errors without a section in docs/troubleshooting.md: {missing}"
    # each says where to import it from, and that is where it is
    for name in classes:
        section = page.split(f"\n### {name}\n", 1)[1].split("\n#", 1)[0]
        where = re.search(r"`from (mlflow_hvd(?:\.errors)?) import (\w+)`", section)
        assert where and where.group(2) == name, (name, section[:200])
        assert getattr(importlib.import_module(where.group(1)), name) is getattr(errors, name)


def test_no_code_in_the_manual_imports_horovods_keras_layer_but_as_the_code_before() -> None:
    """Under Keras 3 a rank refuses Horovod's own Keras layer (IncompatibleImportError):
    a code block of the manual imports it only as the code users migrate from (a block
    headed ``# before``, or a ``before -> after`` line), never as code to copy
    (docs/training-function.md did, while docs/keras.md said it fails)."""
    import re

    from conftest import REPO

    wrong = []
    for page in sorted((REPO / "docs").glob("*.md")):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            if block.lstrip().startswith("# before"):
                continue
            for line in block.splitlines():
                if (re.search(r"\bimport horovod\.(tensorflow\.)?keras\b", line)
                        and "->" not in line):
                    wrong.append(f"{page.name}: {line.strip()}")
    assert wrong == [], wrong


def test_the_license_file_is_the_one_pyproject_declares() -> None:
    """LICENSE holds the Apache License 2.0, the SPDX expression pyproject.toml declares,
    and is the file it lists for the wheel and the sdist (tests/test_quickstart.py finds it
    in both)."""
    import tomllib

    from conftest import REPO

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "http://www.apache.org/licenses/LICENSE-2.0" in text


def test_the_generated_references_are_current_and_complete(tmp_path: Path) -> None:
    """docs/reference/ (every command's flags, every MLproject parameter, every environment
    variable the package reads) is what scripts/reference.py makes of the code now; the
    script refuses a flag without help, a parameter its command does not take, and a
    variable read but not described (or described but no longer read)."""
    import subprocess
    import sys

    from conftest import REPO

    done = subprocess.run([sys.executable, str(REPO / "scripts" / "reference.py"), "--check"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        reference = importlib.import_module("reference")
    finally:
        sys.path.remove(str(REPO / "scripts"))
    # the check is not a formality: a variable the code reads that the page lacks fails it
    module = tmp_path / "mlflow_hvd" / "reads.py"
    module.parent.mkdir()
    module.write_text('import os\nLEVEL = os.environ.get("MLFLOW_HVD_NOT_DESCRIBED")\n')
    original = reference.PACKAGE
    reference.PACKAGE, reference.ROOT = module.parent, tmp_path
    try:
        with pytest.raises(SystemExit, match="MLFLOW_HVD_NOT_DESCRIBED"):
            reference.environment_page()
    finally:
        reference.PACKAGE, reference.ROOT = original, REPO
    page = (REPO / "docs" / "reference" / "mlproject.md").read_text()
    for name in ("np", "min_np", "spark_master", "max_evals", "parallelism"):
        assert f"| `{name}` |" in page, name


GUIDE_EXCLUDED = {"benchmarks.md", "architecture.md", "changelog.md", "development.md"}
# a guide says what a thing is and how to use it; what was measured lives in benchmarks.md,
# how it came to be in the changelog and the architecture page
DIARY = re.compile(r"these machines|tried by hand|(?:un)?tested here|measured here|"
                   r"on this project's machine|on the 2-core machine", re.IGNORECASE)
TIMES = "\u00d7"  # the multiplication sign of a ratio: 0.84x written with it
MEASURED = re.compile(rf"\b\d+(?:\.\d+)?{TIMES}|\b\d[\d,.]*[kM]? (?:rows|steps)/s\b")


def test_guides_hold_no_measurements_nor_a_diary() -> None:
    """Guide pages (docs/*.md but the benchmarks, the architecture, the changelog and the
    development notes) never speak of 'these machines' or 'tried by hand', and state no
    measured ratio or throughput: those live, once, with their date and machine, in
    docs/benchmarks.md, which guides link to."""
    from conftest import REPO

    found = []
    for page in sorted((REPO / "docs").glob("*.md")):
        if page.name in GUIDE_EXCLUDED:
            continue
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for pattern in (DIARY, MEASURED):
                match = pattern.search(line)
                if match:
                    found.append(f"{page.name}:{number}: {match.group(0)!r}")
    assert not found, "\n".join(found)
    assert DIARY.search("not tested here") and MEASURED.search(f"0.84{TIMES} DDP's")
    assert MEASURED.search("4.45M rows/s") and not MEASURED.search(f"k {TIMES} np slots")
