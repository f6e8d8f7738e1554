"""Target architectures: the limits the search space checks before compiling."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """One compilation target. ``name`` is what NVRTC's ``--gpu-architecture`` takes."""

    name: str
    sm: int  # compute capability as an integer, 80 for 8.0
    smem_per_block: int  # bytes of dynamic shared memory one block may opt into
    max_threads: int
    regs_per_sm: int

    def runs_on(self, major: int, minor: int) -> bool:
        """Whether this target's cubins run on a device of compute capability major.minor.

        A cubin runs on its own major version at the same or a later minor; an
        arch-specific target (``sm_90a``) runs only on exactly its device.
        """
        if self.name.endswith("a"):
            return (major, minor) == divmod(self.sm, 10)
        return major == self.sm // 10 and minor >= self.sm % 10

    def as_names(self) -> dict[str, int]:
        """The names a search-space constraint may use for this target."""
        return {
            "SM": self.sm,
            "SMEM_LIMIT": self.smem_per_block,
            "MAX_THREADS": self.max_threads,
            "REGS_PER_SM": self.regs_per_sm,
        }


# Shared-memory opt-in limits per block from the CUDA programming guide's table of
# compute-capability features (163 KB on 8.0, 99 KB on 8.6/8.9, 227 KB on 9.0).
ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("sm_80", 80, 163 * 1024, 1024, 65536),
        Arch("sm_86", 86, 99 * 1024, 1024, 65536),
        Arch("sm_89", 89, 99 * 1024, 1024, 65536),
        Arch("sm_90a", 90, 227 * 1024, 1024, 65536),
    )
}

# Spellings people type for the same target.
_ALIASES = {"sm_90": "sm_90a", "sm90": "sm_90a", "sm90a": "sm_90a", "sm80": "sm_80",
            "sm86": "sm_86", "sm89": "sm_89"}


def get_arch(name: str) -> Arch:
    """Look up a target by name; raises ``ValueError`` listing the known ones."""
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    try:
        return ARCHS[key]
    except KeyError:
        raise ValueError(f"unknown arch {name!r}; known: {', '.join(ARCHS)}") from None


def arch_of_capability(major: int, minor: int) -> Arch:
    """The target to compile for on a device of compute capability ``major.minor``."""
    return get_arch("sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}")
