"""The CLI's shared helpers (cli/common.py): argument types, loading the training
function, exiting."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from mlflow_hvd.cli.common import load_function, whole_number
from mlflow_hvd.errors import ConfigurationError


def test_whole_number_arguments() -> None:
    assert whole_number("2.0") == 2
    with pytest.raises(argparse.ArgumentTypeError, match="^'two' is not a number$"):
        whole_number("two")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'2.5' is not a whole number$"):
        whole_number("2.5")


def test_load_function_from_a_file_and_a_module(tmp_path: Path) -> None:
    script = tmp_path / "my_training_prog.py"
    script.write_text("def train(**kw):\n    return 'trained'\n")
    assert load_function(f"{script}:train")() == "trained"
    assert load_function("os.path:join")("a", "b") == "a/b"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("train", "--train 'train': expected 'path/to/file.py:function' or 'module:function'"),
        ("/no/such.py:train", "--train '/no/such.py:train': no such file /no/such.py"),
        ("no_such_pkg_xyz:train",
         "--train 'no_such_pkg_xyz:train': cannot import no_such_pkg_xyz: No module named "
         "'no_such_pkg_xyz'"),
        ("os.path:nothing_here", "--train 'os.path:nothing_here': os.path has no function "
         "'nothing_here'"),
    ],
)
def test_load_function_refuses_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        load_function(spec)
    assert str(info.value) == message


def test_an_entry_point_exits_at_once_with_its_output_flushed() -> None:
    """``exit_now``: the status, buffered output flushed, ``atexit`` hooks skipped (as
    documented)."""

    code = (
        "import atexit, sys\n"
        "from mlflow_hvd.cli.common import exit_now\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "print('buffered line', end='')\n"  # stdout is a pipe: block-buffered
        "sys.stderr.write('an error line')\n"
        "exit_now(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "buffered line", "an error line")


def test_the_mlproject_gives_each_parameter_the_default_its_command_has() -> None:
    """`mlflow run` passes every parameter, so the MLproject's defaults are what users get;
    the commands' own defaults (run without mlflow) must be the same, and the job options
    among them those of JobConfig (0 for "no limit")."""
    import yaml

    from mlflow_hvd import JobConfig
    from mlflow_hvd.cli import sweep, train

    project = yaml.safe_load((Path(__file__).parent.parent / "MLproject").read_text())
    for entry, command in (("main", train), ("sweep", sweep)):
        defaults = vars(command.parse_args([]))
        parameters = project["entry_points"][entry]["parameters"]
        assert set(parameters) <= set(defaults), entry
        for name, spec in parameters.items():
            given, own = spec["default"], defaults[name]
            same = float(given) == float(own) if spec["type"] == "float" else given == own
            assert same, (entry, name, given, own)
        assert defaults["max_failures"] == JobConfig().max_failures
        assert defaults["timeout"] == (JobConfig().timeout or 0)
