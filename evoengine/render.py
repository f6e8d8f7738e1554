"""Render a family's Jinja2 template over one point of its space into CUDA source.

A candidate's identity is its family, the hash of the family's template files, and every
problem dimension and parameter in declared order. The same string names the compile-cache
entry, the generated source file and the store's unique key.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from evoengine import paths
from evoengine.arch import Arch
from evoengine.space import SearchSpace

KERNEL_NAME = "attn_fwd"


# A template statement that reads another template file: include, import, from ... import.
_USES = re.compile(r'/\*%-?\s*(?:include|import|from)\s+"([^"]+)"')


def _borrowed(folder: Path, root: Path) -> list[Path]:
    """Files of other families' folders that the templates under ``folder`` include or
    import (and those they use in turn), so that a family building on another's headers
    (wgmma_bwd on wgmma's) changes its hash when they change."""
    seen: dict[Path, None] = {}
    todo = [f for f in sorted(folder.rglob("*")) if f.is_file()]
    while todo:
        text = todo.pop().read_text(errors="replace")
        for name in _USES.findall(text):
            f = root / name
            own = f.is_relative_to(folder) or f.is_relative_to(root / "common")
            if f.is_file() and not own and f not in seen:
                seen[f] = None
                todo.append(f)
    return sorted(seen)


@functools.cache
def template_hash(family: str) -> str:
    """Content hash of a family's template folder, the shared includes (templates/common) and
    any file of another family's folder that it uses."""
    h = hashlib.sha256()
    own = paths.family_dir(family)
    if own is None:
        raise ValueError(f"no templates for family {family!r} under "
                         f"{', '.join(map(str, paths.template_dirs()))}")
    for folder in (paths.TEMPLATES / "common", own):
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                h.update(f.relative_to(folder.parent).as_posix().encode() + b"\0")
                h.update(f.read_bytes() + b"\0")
    for f in _borrowed(own, paths.TEMPLATES):
        h.update(f.relative_to(paths.TEMPLATES).as_posix().encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _fmt(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def make_identity(family: str, problem: Mapping[str, object], params: Mapping[str, object]) -> str:
    parts = [f"{k.lower()}{_fmt(v)}" for k, v in (*problem.items(), *params.items())]
    return "-".join([family, *parts, template_hash(family)])


@dataclass(frozen=True)
class Candidate:
    """One point of a space for one problem: everything needed to build and launch it."""

    family: str
    problem: dict[str, object]
    params: dict[str, object]
    derived: dict[str, object] = field(compare=False)

    @property
    def identity(self) -> str:
        return make_identity(self.family, self.problem, self.params)

    @property
    def template_hash(self) -> str:
        return template_hash(self.family)

    @property
    def threads(self) -> int:
        return int(self.derived["THREADS"])  # type: ignore[call-overload]

    @property
    def smem_bytes(self) -> int:
        return int(self.derived["SMEM_BYTES"])  # type: ignore[call-overload]

    @property
    def block_m(self) -> int:
        return int(self.params["BLOCK_M"])  # type: ignore[call-overload]

    def spec(self) -> dict[str, object]:
        """The fields of a kernel spec (what ``evoengine export`` writes for each kernel) that
        the candidate alone decides: what the launcher's kernel classes are built from
        (``spec_args``), so that a parameter reaches a launcher through one mapping."""
        return {"name": self.identity, "family": self.family, "problem": dict(self.problem),
                "params": dict(self.params), "block_m": self.block_m, "threads": self.threads,
                "smem_bytes": self.smem_bytes}

    def defines(self, arch: Arch) -> dict[str, int]:
        """Preprocessor values passed at compile time; the source itself is arch-independent."""
        return {"EVO_SMEM_LIMIT": arch.smem_per_block, "EVO_SMEM_BYTES": self.smem_bytes}


def make_candidate(space: SearchSpace, params: Mapping[str, object],
                   problem: Mapping[str, object], arch: Arch) -> Candidate:
    """A candidate with its derived values; raises ``ValueError`` if constraints reject it."""
    bad = space.violations(params, problem, arch)
    if bad:
        raise ValueError("rejected by the search space: " + "; ".join(bad))
    if not space.problem_names_ok(set(problem)):
        raise ValueError(f"problem must name exactly {sorted(space.problem)} (and what one "
                         f"kind adds: {space.kind_problem}), got {sorted(problem)}")
    ordered = {k: params[k] for k in space.parameters}
    # [problem]'s dimensions in declared order, then those the problem's kind adds.
    problem = {**{k: problem[k] for k in space.problem},
               **{k: v for k, v in problem.items() if k not in space.problem}}
    env = space.env(ordered, problem, arch)
    derived = {k: env[k] for k in space.derived}
    return Candidate(space.family, problem, ordered, derived)


def _environment() -> jinja2.Environment:
    return _environment_for(tuple(str(d) for d in paths.template_dirs()))


@functools.cache
def _environment_for(roots: tuple[str, ...]) -> jinja2.Environment:
    # Statements are written /*% ... %*/ so that inline PTX operands ("{%0, %1}") and C++
    # brace initialisers never read as Jinja; values stay {{ NAME }}.
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(list(roots)),
        block_start_string="/*%",
        block_end_string="%*/",
        comment_start_string="/*#",
        comment_end_string="#*/",
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(candidate: Candidate, templates: Path | None = None) -> str:
    """The candidate's CUDA source, deterministic for a given identity; from the templates
    folder of another tree where ``templates`` is given (a kernel change's twin)."""
    env = _environment_for((str(templates),)) if templates else _environment()
    template = env.get_template(f"{candidate.family}/kernel.cu.j2")
    return template.render(
        identity=candidate.identity,
        family=candidate.family,
        template_hash=candidate.template_hash,
        **candidate.problem,
        **candidate.params,
    )
