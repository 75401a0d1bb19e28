"""The changes ``python -m mlflow_hvd.cli.horovod`` makes to Horovod 0.28.1's source before it
builds it, each with the condition it applies under and its reason.

Horovod's last release (0.28.1, June 2023) predates the frameworks users run now, and upstream
merges nothing (the pull requests for TensorFlow 2.19/2.20, horovod#4302 and #4314, are open).
The sdist is checked against its sha256 first; every line a patch changes is then compared
with the line as released, and any difference refuses the build (another version or a modified
sdist is never guessed at).

=================  ==============================================  ==========================
patch              applies to                                      why
=================  ==============================================  ==========================
``cxx17``          builds with PyTorch < 2.14                      PyTorch's headers refuse
                                                                   C++14
``cxx20``          builds with PyTorch >= 2.14                     PyTorch 2.14's headers
                                                                   refuse anything before
                                                                   C++20
``torch-cpu``      a CUDA build of PyTorch (every Linux wheel on   Horovod then asks for a
                   PyPI) where no CUDA toolkit is usable and no    CUDA toolkit and stops
                   GPU operation was asked for                     without one
``xla-ops``        TensorFlow >= 2.19                              TF's XLA headers include
                                                                   headers its wheels no
                                                                   longer ship
``no-debug-info``  every build                                     debug information costs
                                                                   about a quarter of the
                                                                   compile time and most of
                                                                   the wheel
``tf-cpu-on-gpu``  builds with TensorFlow and GPU operations       a CUDA build's TensorFlow
                   (NCCL), where TensorFlow is built without CUDA  extension needs two GPU
                   (tensorflow-cpu)                                symbols tensorflow-cpu
                                                                   lacks: it would not load
``gpu-runpath``    builds with GPU operations (NCCL)               CMake's run path names
                                                                   the build machine's
                                                                   toolkit and temporary
                                                                   directories
=================  ==============================================  ==========================
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
class Build:
    """What decides which patches a build needs: its frameworks, and whether its PyTorch is
    a CUDA build compiled here for CPU tensors only (:func:`cpu_only_torch`)."""

    tensorflow: str  # "": a build without TensorFlow
    torch: str = ""  # "": a build without PyTorch
    torch_for_cpu: bool = False
    gpu: bool = False  # GPU operations asked for (HOROVOD_GPU_OPERATIONS, ...)


@dataclass(frozen=True)
class Patch:
    """A set of edits made together, under a condition on the build's frameworks."""

    name: str
    why: str
    edits: tuple[Edit, ...]
    tensorflow_from: str = ""  # applies from this TensorFlow on ("": any)
    with_torch: bool = False  # applies only to builds with PyTorch
    with_tensorflow: bool = False  # applies only to builds with TensorFlow
    torch_from: str = ""  # with PyTorch from this release on ("": any)
    torch_below: str = ""  # with PyTorch before this release ("": any)
    torch_for_cpu: bool = False  # only to a CUDA-built PyTorch built here for CPU tensors
    gpu: bool = False  # only to builds with GPU operations

    def applies(self, build: Build) -> bool:
        if self.gpu and not build.gpu:
            return False
        if self.with_torch and not build.torch:
            return False
        if (self.with_tensorflow or self.tensorflow_from) and not build.tensorflow:
            return False  # the TensorFlow extension is not compiled
        if self.torch_for_cpu and not build.torch_for_cpu:
            return False
        if build.torch and (self.torch_from or self.torch_below):
            release = _release(build.torch)
            if self.torch_from and release < Version(self.torch_from):
                return False
            if self.torch_below and release >= Version(self.torch_below):
                return False
        return not self.tensorflow_from or (
            _release(build.tensorflow) >= Version(self.tensorflow_from))


def _release(found: str) -> Version:
    return Version(Version(found).base_version)


TORCH_CXX20 = "2.14"  # PyTorch's headers need C++20 from this release on
# Horovod's own sources, Gloo and the TensorFlow extension: C++17 in every build with PyTorch
TOP_CXX17 = Edit("CMakeLists.txt", 19, "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)")


def _torch_standard(standard: str) -> Edit:
    """The C++ standard Horovod's PyTorch extension is compiled as."""
    return Edit("horovod/torch/CMakeLists.txt", 67, "    set(CMAKE_CXX_STANDARD 14)",
                f"    set(CMAKE_CXX_STANDARD {standard})")


CXX17 = Patch(
    "cxx17",
    "Horovod compiles its PyTorch extension as C++14, which PyTorch's headers refuse (`C++17 or "
    "later compatible compiler is required to use PyTorch`); Horovod's main branch made the "
    "same change after the release (horovod#3998)",
    (TOP_CXX17, _torch_standard("17")),
    with_torch=True,
    torch_below=TORCH_CXX20,
)
CXX20 = Patch(
    "cxx20",
    "PyTorch 2.14's headers refuse anything before C++20 (torch/csrc/api/include/torch/all.h: "
    "`C++20 or later compatible compiler is required to use PyTorch`): the PyTorch extension "
    "(with Horovod's common sources, which it compiles again) is built as C++20. Gloo and the "
    "rest are built as C++17, as the cxx17 patch does: a Gloo built as C++14 defines "
    "gloo::rendezvous::Store::kDefaultTimeout out of line, which C++17 and later make an "
    "inline variable in Horovod's http_store.cc, and the link then finds it twice",
    (TOP_CXX17, _torch_standard("20")),
    with_torch=True,
    torch_from=TORCH_CXX20,
)
TORCH_CPU = Patch(
    "torch-cpu",
    "Every Linux wheel of PyTorch on PyPI is a CUDA build; Horovod then compiles its PyTorch "
    "extension for CUDA and asks for a CUDA toolkit (find_package(CUDAToolkit REQUIRED), "
    "then torch's CUDA libraries), which a CPU machine lacks or holds only in part. Where no "
    "usable toolkit is found and no GPU operation was asked for (HOROVOD_GPU_OPERATIONS, "
    "HOROVOD_GPU_ALLREDUCE, ...), the extension is built as for a CPU build of PyTorch: it "
    "handles CPU tensors, as every rank on such a machine uses. With a toolkit, or GPU "
    "operations asked for, the build is Horovod's own",
    (
        Edit("cmake/Modules/FindPytorch.cmake", 25,
             'execute_process(COMMAND ${PY_EXE} -c "import torch; from torch.utils.cpp_extension'
             ' import CUDA_HOME; print(True if ((torch.version.cuda is not None) and (CUDA_HOME'
             ' is not None)) else False)"',
             'execute_process(COMMAND ${PY_EXE} -c "print(False)"'),
    ),
    with_torch=True,
    torch_for_cpu=True,
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
NO_DEBUG_INFO = Patch(
    "no-debug-info",
    "Horovod builds as RelWithDebInfo, whose flags it raises from -O2 to -O3 and which keep "
    "-g: debug information for every object, its own, Gloo's and the frameworks' headers. "
    "It costs about a quarter of the compile time (horovod/tensorflow/mpi_ops.cc against "
    "TensorFlow 2.21 on 2 x86-64 cores, 2026-12-05: 44.9 s with -g, 32.6 s without) and "
    "most of the wheel, and only a debugger reads it. The flags become -O3 -DNDEBUG, as a "
    "Release build's: the code is optimised as before. HOROVOD_DEBUG=1 still builds "
    "Horovod's Debug build",
    tuple(Edit("CMakeLists.txt", line,
               f'string(REPLACE "-O2" "-O3" CMAKE_{lang}_FLAGS_RELWITHDEBINFO '
               f'"${{CMAKE_{lang}_FLAGS_RELWITHDEBINFO}}")',
               f'string(REPLACE "-O2 -g" "-O3" CMAKE_{lang}_FLAGS_RELWITHDEBINFO '
               f'"${{CMAKE_{lang}_FLAGS_RELWITHDEBINFO}}")')
          for line, lang in ((89, "C"), (90, "CXX"), (91, "CUDA"))),
)
# Definitions of the two kinds of TensorFlow GPU symbols Horovod's TensorFlow extension uses
# and tensorflow-cpu does not export; compiled only where CMake finds TensorFlow without CUDA
_TF_GPU_STUBS = r"""} // namespace horovod

#if HAVE_CUDA && HOROVOD_TF_WITHOUT_CUDA
// mlflow_hvd's tf-cpu-on-gpu patch: this TensorFlow has no GPU device, so the GPU kernels
// above are registered and never run; these definitions only let the library load.
#include <cstdio>
#include <cstdlib>
#include "tensorflow/core/kernels/dense_update_functor.h"

namespace stream_executor {
namespace gpu {
GpuStreamHandle AsGpuStreamValue(Stream*) {
  std::fprintf(stderr, "horovod: a GPU stream asked of a TensorFlow built without CUDA\n");
  std::abort();
}
} // namespace gpu
} // namespace stream_executor

namespace tensorflow {
namespace functor {
#define HVD_TF_GPU_STUB(T)                                                          \
  template <>                                                                       \
  void DenseUpdate<GPUDevice, T, ASSIGN>::operator()(                               \
      const GPUDevice&, typename TTypes<T>::Flat, typename TTypes<T>::ConstFlat) {  \
    std::fprintf(stderr, "horovod: a GPU update asked of a TensorFlow built "       \
                         "without CUDA\n");                                        \
    std::abort();                                                                   \
  }
HVD_TF_GPU_STUB(Eigen::half)
HVD_TF_GPU_STUB(int8)
HVD_TF_GPU_STUB(bool)
HVD_TF_GPU_STUB(double)
HVD_TF_GPU_STUB(float)
HVD_TF_GPU_STUB(uint8)
HVD_TF_GPU_STUB(int32)
HVD_TF_GPU_STUB(int64_t)
#undef HVD_TF_GPU_STUB
} // namespace functor
} // namespace tensorflow
#endif // HAVE_CUDA && HOROVOD_TF_WITHOUT_CUDA"""
TF_XLA_SOURCES = 'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")'
TF_CPU_ON_GPU = Patch(
    "tf-cpu-on-gpu",
    "A build with GPU operations compiles Horovod's TensorFlow extension with its GPU "
    "kernels, which use TensorFlow's DenseUpdate<GpuDevice, T, ASSIGN> and "
    "stream_executor::gpu::AsGpuStreamValue; tensorflow-cpu exports neither, and the "
    "extension fails to load (undefined symbol). Where CMake finds TensorFlow built without "
    "CUDA, mpi_ops.cc gets definitions of those nine symbols that abort with a message: such "
    "a TensorFlow has no GPU device, so the kernels that would call them never run. One "
    "wheel then serves GPU PyTorch (NCCL) and CPU TensorFlow; compiling the TensorFlow "
    "sources without HAVE_GPU instead would change the layout of Horovod's common Event and "
    "ReadyEvent, which the rest of the library is built with",
    (
        Edit("horovod/tensorflow/CMakeLists.txt", 79, TF_XLA_SOURCES,
             TF_XLA_SOURCES + "\n"
             'execute_process(COMMAND ${PY_EXE} -c "import tensorflow as tf; '
             'print(tf.test.is_built_with_cuda())"\n'
             "                OUTPUT_VARIABLE Tensorflow_CUDA OUTPUT_STRIP_TRAILING_WHITESPACE "
             "ERROR_QUIET)\n"
             'if(HAVE_CUDA AND NOT Tensorflow_CUDA MATCHES "True")\n'
             '    message(STATUS "TensorFlow is built without CUDA: its GPU kernels load '
             'and never run")\n'
             "    set_source_files_properties(${PROJECT_SOURCE_DIR}/horovod/tensorflow/"
             "mpi_ops.cc PROPERTIES COMPILE_DEFINITIONS HOROVOD_TF_WITHOUT_CUDA=1)\n"
             "endif()"),
        Edit("horovod/tensorflow/mpi_ops.cc", 1926, "} // namespace horovod", _TF_GPU_STUBS),
    ),
    gpu=True,
    with_tensorflow=True,
)
GPU_RUNPATH = Patch(
    "gpu-runpath",
    "Horovod ships its extensions as CMake linked them, with CMake's build run path: every "
    "directory of a library linked by its full path, i.e. the build machine's CUDA toolkit "
    "(/usr/local/cuda/lib64), PyTorch's lib directory in the build's environment and the "
    "build's temporary directory. A GPU node has none of them (and a directory that exists "
    "there by chance would be searched first). CMake's build run path is left out; the "
    "extensions find NCCL through the one run path the build gives (beside Horovod in "
    "site-packages, or the system's), and the frameworks' libraries as before: loaded by "
    "`import tensorflow` and `import torch`",
    (Edit("CMakeLists.txt", 21, "set(CMAKE_CXX_EXTENSIONS OFF)",
          "set(CMAKE_CXX_EXTENSIONS OFF)\nset(CMAKE_SKIP_BUILD_RPATH ON)"),),
    gpu=True,
)
PATCHES = (CXX17, CXX20, TORCH_CPU, XLA_OPS, NO_DEBUG_INFO, TF_CPU_ON_GPU, GPU_RUNPATH)


def needed(build: Build) -> tuple[Patch, ...]:
    """The patches ``build`` applies, in the order of :data:`PATCHES`."""
    return tuple(p for p in PATCHES if p.applies(build))


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
