"""The changes ``python -m mlflow_hvd.cli.horovod`` makes to Horovod 0.28.1's source before it
builds it, each with the condition it applies under and its reason.

Horovod's last release (0.28.1, June 2023) predates the frameworks users run now, and upstream
merges nothing (the pull requests for TensorFlow 2.19/2.20, horovod#4302 and #4314, are open).
The sdist is checked against its sha256 first; every line a patch changes is then compared
with the line as released, and any difference refuses the build (another version or a modified
sdist is never guessed at). A build that needs no patch compiles the sdist unchanged.

==============  ==============================================  ==========================
patch           applies to                                      why
==============  ==============================================  ==========================
``cxx17``       builds with PyTorch                             PyTorch's headers refuse
                                                                C++14
``xla-ops``     TensorFlow >= 2.19                              TF's XLA headers include
                                                                headers its wheels no
                                                                longer ship
==============  ==============================================  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from mlflow_hvd.errors import InstallError


@dataclass(frozen=True)
class Edit:
    """One line of one file of the sdist: what it must be as released, and what it becomes."""

    file: str
    line: int  # 1-based
    released: str
    patched: str


@dataclass(frozen=True)
class Patch:
    """A set of edits made together, under a condition on the build's frameworks."""

    name: str
    why: str
    edits: tuple[Edit, ...]
    tensorflow_from: str = ""  # applies from this TensorFlow on ("": any)
    with_torch: bool = False  # applies only to builds with PyTorch

    def applies(self, tensorflow: str, torch: str) -> bool:
        if self.with_torch and not torch:
            return False
        if self.tensorflow_from:
            release = Version(Version(tensorflow).base_version)
            return release >= Version(self.tensorflow_from)
        return True


CXX17 = Patch(
    "cxx17",
    "Horovod compiles its PyTorch extension as C++14, which PyTorch's headers refuse (`C++17 or "
    "later compatible compiler is required to use PyTorch`); Horovod's main branch made the "
    "same change after the release (horovod#3998)",
    (
        Edit("CMakeLists.txt", 19, "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)"),
        Edit("horovod/torch/CMakeLists.txt", 67, "    set(CMAKE_CXX_STANDARD 14)",
             "    set(CMAKE_CXX_STANDARD 17)"),
    ),
    with_torch=True,
)
XLA_OPS = Patch(
    "xla-ops",
    "horovod/tensorflow/xla_mpi_ops.cc includes TensorFlow's XLA headers, which from 2.19 on "
    "include headers TensorFlow's wheels do not ship (llvm/ADT/ArrayRef.h on 2.19, "
    "highwayhash/arch_specific.h on 2.21). The file holds only Horovod's XLA custom-call ops "
    "(HOROVOD_ENABLE_XLA_OPS, GPU builds); its guard is narrowed so they are left out for "
    "TensorFlow >= 2.19. Every other op is built as released",
    (
        Edit("horovod/tensorflow/xla_mpi_ops.cc", 23, "#if TENSORFLOW_VERSION >= 2006000000",
             "#if TENSORFLOW_VERSION >= 2006000000 && TENSORFLOW_VERSION < 2019000000"),
    ),
    tensorflow_from="2.19",
)
PATCHES = (CXX17, XLA_OPS)


def needed(tensorflow: str, torch: str) -> tuple[Patch, ...]:
    """The patches a build against ``tensorflow`` (and ``torch``, "" for none) applies."""
    return tuple(p for p in PATCHES if p.applies(tensorflow, torch))


def apply(source: Path, patches: tuple[Patch, ...], version: str) -> None:
    """Apply ``patches`` to the unpacked sdist in ``source``; every line is checked before any
    file is written.

    Raises:
        InstallError: A line to change is not as Horovod ``version`` released it.
    """
    files: dict[str, list[str]] = {}
    for patch in patches:
        for edit in patch.edits:
            if edit.file not in files:
                files[edit.file] = (source / edit.file).read_text().split("\n")
            lines = files[edit.file]
            found = lines[edit.line - 1] if len(lines) >= edit.line else "<missing>"
            if found != edit.released:
                raise InstallError(
                    f"cannot apply the {patch.name} patch to Horovod {version}: line "
                    f"{edit.line} of {edit.file} is {found!r}, expected {edit.released!r} "
                    "(another version or a modified sdist); nothing was built"
                )
            lines[edit.line - 1] = edit.patched
    for name, lines in files.items():
        (source / name).write_text("\n".join(lines))
