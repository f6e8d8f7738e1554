"""The launcher: load tuned attention kernels and launch them on torch tensors, with cupy and
torch only.

It is the one launcher of the project, forward and backward: ``evoengine.runtime.Kernel``,
``evoengine.backward.BackwardKernel`` and ``evoengine.load`` use it from the package, and
``evoengine export`` copies the text of its modules, in the order of ``MODULES``, into every
exported module (``module_text``). So its modules import nothing but torch, cupy (lazily: a
module built on it still imports on a machine without a GPU), the standard library and each
other (``from evoengine.launch.X import ...`` at module level only: those lines are dropped
when the modules are joined into one namespace, so top-level names must not collide).

- ``core``: errors, input checks, SDPA with the kernels' semantics, devices, loading and
  launching, parameter buffers;
- ``tma``: TMA tensor maps (the wgmma family);
- ``forward``: ``CudaKernel``, the forward (its docstring holds the kernels' ABI);
- ``varlen``: ``CudaVarlenKernel``, the forward on ragged batches (packed q, k, v with
  cu_seqlens), its input checks and its SDPA fallback;
- ``backward``: ``CudaBackward``, the backward's three kernels (four with a group split;
  their ABI);
- ``varlen_backward``: ``CudaVarlenBackward``, the backward on ragged batches, and the
  autograd function that gives a varlen forward these kernels' gradients;
- ``decode``: ``CudaDecode``, decode over a contiguous or paged KV cache (its two kernels'
  ABI, the input and value checks), and ``TunedDecode``, the exported ``attention_decode``;
- ``dispatch``: what an export carries (packed cubins, hashes), the kernel class of each
  problem kind, the dispatch table;
- ``explain``: which dispatch entry serves a call (tuned, or derived at export), in words;
- ``transformers``: the Transformers attention function and its registration;
- ``tuned``: ``TunedAttention`` and its ``torch.library`` ops.

A new kind of kernel is a module here (its class with ``kind``, ``spec_args`` and
``from_spec``), listed in ``MODULES`` before ``dispatch`` and in ``dispatch.KERNEL_CLASSES``.
``spec_args`` is the one mapping from a kernel spec (an export's, or ``Candidate.spec()`` for a
candidate being searched) to the class's arguments: a new launch-time parameter goes there.
"""

from __future__ import annotations

import ast
from pathlib import Path

from evoengine.launch.backward import (
    BACKWARD_ENTRIES,
    BWD_MAIN_ARGS,
    BWD_MAIN_TMA_ARGS,
    BWD_MAIN_TMA_KV_ARGS,
    BWD_POST_ARGS,
    BWD_PRE_ARGS,
    POST_THREADS,
    PRE_ROWS,
    PRE_THREADS,
    CudaBackward,
)
from evoengine.launch.core import (
    DTYPE_NAMES,
    FALLBACKS,
    KERNEL_DTYPES,
    KERNEL_NAME,
    LOG2E,
    MIN_SM,
    NVRTC_OPTIONS,
    IntegrityError,
    NoKernelError,
    ParamBuffer,
    Problem,
    check_grid,
    check_inputs,
    check_like,
    check_out,
    cubin_runs_on,
    device_arch,
    rows_aligned,
    sdpa_attention,
    sdpa_attention_grads,
    softmax_scale,
)
from evoengine.launch.decode import (
    DECODE_ENTRIES,
    CudaDecode,
    TunedDecode,
    check_decode_inputs,
    check_decode_values,
    sdpa_decode,
)
from evoengine.launch.dispatch import (
    KERNEL_CLASSES,
    KINDS,
    Entry,
    describe,
    dispatch_table,
    kernel_from_spec,
    nearest,
    pack_cubin,
    sha256,
    unpack_cubin,
)
from evoengine.launch.explain import Explanation, explain_call
from evoengine.launch.forward import CudaKernel
from evoengine.launch.tma import TMA_FAMILIES, TmaParams, tma_geometry, tma_grid, tma_params
from evoengine.launch.transformers import register_hf, transformers_attention
from evoengine.launch.tuned import TunedAttention
from evoengine.launch.varlen_backward import CudaVarlenBackward

# The modules an exported module carries, in the order they are joined (each after those it
# imports from).
MODULES = ("core", "tma", "forward", "varlen", "backward", "varlen_backward", "decode",
           "dispatch", "explain", "transformers", "tuned")
PACKAGE = __name__

__all__ = [
    "BACKWARD_ENTRIES", "BWD_MAIN_ARGS", "BWD_MAIN_TMA_ARGS", "BWD_MAIN_TMA_KV_ARGS",
    "BWD_POST_ARGS", "BWD_PRE_ARGS",
    "DECODE_ENTRIES",
    "DTYPE_NAMES", "CudaDecode", "TunedDecode", "check_decode_inputs", "check_decode_values",
    "sdpa_decode",
    "FALLBACKS", "KERNEL_CLASSES", "KERNEL_DTYPES", "KERNEL_NAME", "KINDS", "LOG2E", "MIN_SM",
    "MODULES", "NVRTC_OPTIONS", "POST_THREADS", "PRE_ROWS", "PRE_THREADS", "TMA_FAMILIES",
    "CudaBackward", "CudaKernel", "CudaVarlenBackward", "Entry", "Explanation",
    "IntegrityError", "NoKernelError",
    "ParamBuffer", "Problem", "TmaParams", "TunedAttention", "check_grid", "check_inputs",
    "check_like", "check_out", "cubin_runs_on", "describe", "device_arch", "dispatch_table",
    "explain_call", "kernel_from_spec", "module_paths", "module_text", "nearest", "pack_cubin",
    "register_hf", "rows_aligned", "sdpa_attention", "sdpa_attention_grads", "sha256",
    "softmax_scale", "tma_geometry", "tma_grid", "tma_params", "transformers_attention",
    "unpack_cubin",
]


def module_paths() -> list[Path]:
    """The launcher's module files, in ``MODULES`` order."""
    here = Path(__file__).parent
    return [here / f"{name}.py" for name in MODULES]


def _is_own_import(node: ast.stmt) -> bool:
    return isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + ".")


def _joined_imports(nodes: list[ast.Import | ast.ImportFrom]) -> str:
    """The outside imports of every module, each name once: the standard library first."""
    plain: set[str] = set()
    named: dict[str, set[str]] = {}
    for node in nodes:
        names = {a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names}
        if isinstance(node, ast.Import):
            plain |= {f"import {n}" for n in names}
        else:
            named.setdefault(node.module or "", set()).update(names)
    lines = sorted(plain) + [f"from {m} import {', '.join(sorted(ns))}" for m, ns in named.items()]
    return "\n".join(sorted(lines, key=lambda s: (s.split()[1].split(".")[0] == "torch",
                                                   s.startswith("from"), s)))


def module_text() -> str:
    """The launcher as one namespace: each module's code in ``MODULES`` order, without its
    docstring, its ``from __future__`` line and its imports of sibling modules (the names
    are then all in one place), the outside imports gathered once at the top."""
    imports: list[ast.Import | ast.ImportFrom] = []
    bodies: list[str] = []
    for path in module_paths():
        text = path.read_text()
        lines = text.split("\n")
        tree = ast.parse(text)
        drop: set[int] = set()
        for i, node in enumerate(tree.body):
            start, end = node.lineno - 1, (node.end_lineno or node.lineno)
            is_doc = (i == 0 and isinstance(node, ast.Expr)
                      and isinstance(getattr(node.value, "value", None), str))
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if not (_is_own_import(node) or (isinstance(node, ast.ImportFrom)
                                                 and node.module == "__future__")):
                    imports.append(node)
                drop.update(range(start, end))
            elif is_doc:
                drop.update(range(start, end))
        body = "\n".join(line for i, line in enumerate(lines) if i not in drop)
        bodies.append(f"# ---- launcher: evoengine/launch/{path.name} "
                      + "-" * max(4, 60 - len(path.name)) + "\n\n" + body.strip("\n") + "\n")
    return _joined_imports(imports) + "\n\n" + "\n\n".join(bodies)
