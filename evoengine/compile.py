"""Offline compilation with NVRTC: source to cubin plus the compiler's resource report.

Runs without a GPU or a driver (cuda-bindings' NVRTC is a plain library), so every target
can be checked on a CPU-only machine, and the same path builds the cubins a GPU loads. A
compile error is a result (``ok=False`` with the log), never an exception.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import multiprocessing as mp
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from evoengine import paths
from evoengine.arch import Arch, get_arch
from evoengine.render import Candidate, render

# Where the launcher (evoengine/launch/) keeps NVRTC_OPTIONS; read as text, not imported.
LAUNCHER = Path(__file__).with_name("launch") / "core.py"


@dataclass(frozen=True)
class CompileResult:
    identity: str
    arch: str
    ok: bool
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_bytes: int | None = None
    smem_bytes: int | None = None  # dynamic shared memory the launch reserves
    seconds: float = 0.0
    error: str | None = None
    # ptxas's code where it serialised the kernel's wgmma instructions ("C7518"): a kernel that
    # runs correctly, every wgmma waited for before the next (1.2-1.3x slower on the H100,
    # docs/NOTES.md, "TILE_OVERLAP"); None where it did not (or no wgmma).
    serialized: str | None = None
    log: str = field(default="", repr=False)
    cubin: bytes | None = field(default=None, repr=False)

    @property
    def spill_bytes(self) -> int | None:
        if self.spill_stores is None or self.spill_loads is None:
            return None
        return self.spill_stores + self.spill_loads

    def report(self) -> dict[str, object]:
        """The JSON-able summary, without the cubin and the full log."""
        out = asdict(self)
        out.pop("cubin")
        out.pop("log")
        out["spill_bytes"] = self.spill_bytes
        return out


def cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h and mma.h, which the wmma family includes."""
    found = []
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            found.append(Path(os.environ[env]) / "include")
    found.append(Path("/usr/local/cuda/include"))
    for entry in sys.path:  # the nvidia-cuda-runtime wheel's headers
        found.extend(sorted(Path(entry).glob("nvidia/cu*/include")))
        found.append(Path(entry) / "nvidia" / "cuda_runtime" / "include")
    seen: list[str] = []
    for d in found:
        if (d / "cuda_fp16.h").is_file() and str(d) not in seen:
            seen.append(str(d))
    return seen[:1]


@functools.cache
def launcher_options() -> tuple[str, ...]:
    """``NVRTC_OPTIONS`` of ``launch/core.py``, in the launcher exported modules carry, so a
    kernel built there on another GPU gets the flags it was built with here. Read from the
    file, not imported: the launcher imports torch, which offline compilation (the CLI and
    every compile worker) does without."""
    for node in ast.parse(LAUNCHER.read_text()).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "NVRTC_OPTIONS"):
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError(f"{LAUNCHER} defines no NVRTC_OPTIONS")


def nvrtc_options(arch: Arch, defines: dict[str, int]) -> list[str]:
    """The launcher's options plus the target, ptxas' resource report, defines and headers."""
    opts = [f"--gpu-architecture={arch.name}", *launcher_options(), "-Xptxas=-v"]
    opts += [f"-D{k}={v}" for k, v in defines.items()]
    opts += [f"-I{d}" for d in cuda_include_dirs()]
    return opts


@functools.cache
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"nvrtc {major}.{minor}"


_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SERIALIZED = re.compile(r"\((C\d+)\) Potential Performance Loss: wgmma\.mma_async "
                         r"instructions are serialized")


def serialized_code(log: str) -> str | None:
    """ptxas's code (``C7518``) where its log says it serialised a kernel's wgmma
    instructions, else None."""
    found = _SERIALIZED.search(log)
    return found.group(1) if found else None


def compile_source(source: str, arch: Arch, defines: dict[str, int], *, identity: str = "",
                   smem_bytes: int | None = None) -> CompileResult:
    """Compile one translation unit to a cubin for ``arch``."""
    from cuda.bindings import nvrtc

    start = time.perf_counter()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{identity or 'kernel'}.cu".encode(),
                                         0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return CompileResult(identity, arch.name, False, error=f"nvrtcCreateProgram: {err}")
    try:
        opts = [o.encode() for o in nvrtc_options(arch, defines)]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\0 ").decode(errors="replace")
        seconds = time.perf_counter() - start
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return CompileResult(identity, arch.name, False, seconds=seconds,
                                 error=_first_error(log), log=log, smem_bytes=smem_bytes)
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    # A cubin may hold several kernels (a backward family's three): the report is the
    # largest register count and stack frame, and the spills of all of them together.
    regs = [int(m.group(1)) for m in _REGS.finditer(log)]
    spills = [tuple(map(int, m.groups())) for m in _SPILL.finditer(log)]
    return CompileResult(
        identity, arch.name, True,
        registers=max(regs) if regs else None,
        stack_bytes=max(s[0] for s in spills) if spills else None,
        spill_stores=sum(s[1] for s in spills) if spills else None,
        spill_loads=sum(s[2] for s in spills) if spills else None,
        smem_bytes=smem_bytes, seconds=seconds,
        serialized=serialized_code(log), log=log, cubin=cubin,
    )


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line:
            return line.strip()
    return log.strip().splitlines()[0] if log.strip() else "compilation failed"


def compile_candidate(candidate: Candidate, arch: Arch | str) -> CompileResult:
    """Render and compile, going through the on-disk cubin cache."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    cached = _cache_path(candidate, arch)
    meta = cached.with_suffix(".json")
    if cached.is_file() and meta.is_file():
        report = json.loads(meta.read_text())
        return CompileResult(**{**report, "cubin": cached.read_bytes(), "log": ""})
    result = compile_source(render(candidate), arch, candidate.defines(arch),
                            identity=candidate.identity, smem_bytes=candidate.smem_bytes)
    if result.ok and result.cubin is not None:
        _cache_write(cached, result)
    return result


def is_cached(candidate: Candidate, arch: Arch | str) -> bool:
    """Whether ``compile_candidate`` would serve this candidate from the disk cache."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    path = _cache_path(candidate, arch)
    return path.is_file() and path.with_suffix(".json").is_file()


# Longest cache entry name written as the identity itself: file systems take 255 bytes a name,
# and _cache_write adds ".<pid>.tmp" while writing. An identity grows with its space's
# parameters (a ragged wgmma point passed 240 characters); longer ones go by a hash.
CACHE_NAME_MAX = 200


def _cache_path(candidate: Candidate, arch: Arch) -> Path:
    """Keyed by identity and target, and by the compiler and its options: a cubin from another
    NVRTC or other flags is never served. Include paths are left out of the key (they name
    where the same headers live on this machine). Named by the identity where that fits
    CACHE_NAME_MAX, else by the family and a hash of the identity."""
    opts = [o for o in nvrtc_options(arch, candidate.defines(arch)) if not o.startswith("-I")]
    key = hashlib.sha256("\0".join([nvrtc_version(), *opts]).encode()).hexdigest()[:10]
    name = f"{candidate.identity}-{key}.cubin"
    if len(name) > CACHE_NAME_MAX:
        digest = hashlib.sha256(candidate.identity.encode()).hexdigest()[:24]
        name = f"{candidate.family}-{digest}-{key}.cubin"
    return paths.cache_dir() / "cubin" / arch.name / name


def _cache_write(path: Path, result: CompileResult) -> None:
    """Write cubin then report, each atomically, so a reader never sees half an entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    report = result.report()
    report.pop("spill_bytes")
    for target, data in ((path, result.cubin), (path.with_suffix(".json"),
                                                json.dumps(report).encode())):
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)  # type: ignore[arg-type]
        os.replace(tmp, target)


def _compile_job(args: tuple[Candidate, str]) -> CompileResult:
    return compile_candidate(*args)


def compile_many(candidates: Iterable[Candidate], arch: Arch | str,
                 workers: int | None = None) -> Iterator[CompileResult]:
    """Compile in worker processes; results come back in the order given."""
    arch_name = arch if isinstance(arch, str) else arch.name
    jobs = [(c, arch_name) for c in candidates]
    workers = workers or min(len(jobs), os.cpu_count() or 1) or 1
    if workers == 1:
        yield from map(_compile_job, jobs)
        return
    # Spawned, not forked: the caller may hold threads (CUDA's, torch's, a notebook's), and the
    # forked child of a threaded process can deadlock on a lock one of them held (Python 3.12
    # warns so in the GPU tests). Workers read the caller's environment (EVOENGINE_CACHE,
    # EVOENGINE_TEMPLATES), not its module state.
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        yield from pool.map(_compile_job, jobs)


def cuobjdump_path() -> str | None:
    """cuobjdump (to read a cubin's SASS) from PATH, the CUDA toolkit, or the
    nvidia-cuda-cuobjdump wheel; None when there is none."""
    import shutil
    import sys

    found = shutil.which("cuobjdump")
    if found:
        return found
    roots = [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    roots.append(Path("/usr/local/cuda"))
    for entry in sys.path:
        roots.extend(sorted(Path(entry).glob("nvidia/cu*")))
    for root in roots:
        if (root / "bin" / "cuobjdump").is_file():
            return str(root / "bin" / "cuobjdump")
    return None
