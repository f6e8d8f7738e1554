"""Ship the winners: the store's best kernels as one standalone module, or loaded in-process.

``export_best`` writes a Python module that needs only torch and cupy: the launcher
(``evoengine/launch/``, its modules joined verbatim), and for each rank-1 elite of the target,
forward, backward or decode, its rendered CUDA source, its cubin for that target, their
sha256, its parameters, its kind and the workload it won, plus a dispatch table over them (one
per kind: the backward's serves the autograd formula of the module's ``attention``, decode's
its ``attention_decode``). ``load`` builds
the same callable straight from the store. Compiling needs no GPU, so a module for any
target can be exported anywhere.
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import itertools
import json
import os
import pprint
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import sqlalchemy as sa

from evoengine import paths
from evoengine._version import __version__
from evoengine.arch import Arch, get_arch
from evoengine.compile import compile_many, compile_source, nvrtc_version
from evoengine.launch import (
    KINDS,
    Entry,
    TunedAttention,
    describe,
    dispatch_table,
    kernel_from_spec,
    module_text,
    pack_cubin,
    sha256,
)
from evoengine.problems import problem, workload_from_dict, workload_from_key
from evoengine.provenance import git_commit
from evoengine.render import Candidate, make_candidate, make_identity, render
from evoengine.space import SearchSpace
from evoengine.store import CandidateRecord, EliteRecord, RunRecord, Store
from evoengine.workload import Workload

DEFAULT_STORE = paths.DEFAULT_STORE


class ExportError(ValueError):
    """Nothing to export, or an elite that cannot be built; the message says which."""


def _shown(store: Store) -> str:
    """The store's URL as shown to people: without its password."""
    return sa.make_url(store.url).render_as_string(hide_password=True)


@dataclass(frozen=True)
class Winner:
    """A rank-1 elite with what it was measured on."""

    elite: EliteRecord
    candidate: CandidateRecord
    workload: Workload
    run: RunRecord | None


def _workload_of(elite: EliteRecord, run: RunRecord | None) -> Any:
    """What the elite was measured on (a workload of its problem's kind): its run's workload,
    else what its key says."""
    if run is not None:
        try:
            return workload_from_dict(run.workload)
        except (TypeError, ValueError):
            pass
    try:
        return workload_from_key(elite.workload_key)
    except ValueError as e:
        raise ExportError(f"elite {elite.identity}: cannot tell its workload ({e})") from None


# The problem kinds an exported module dispatches: the forward, the backward that its
# autograd formula launches, and decode (its attention_decode).
EXPORTED_KINDS = KINDS


def winners(store: Store, arch: Arch, study: str | None = None,
            tune: str | None = None) -> list[Winner]:
    """The best elite of every workload on ``arch`` whose kind is exported, of runs of
    ``study`` if given, or of the studies of ``evoengine tune`` named ``tune``
    (``<tune>/...``)."""
    found = []
    runs: dict[int, RunRecord | None] = {}
    taken: set[str] = set()
    for elite in sorted(store.elites(arch=arch.name), key=lambda e: e.rank):
        if elite.workload_key in taken:
            continue
        run = None
        if elite.run_id is not None:
            if elite.run_id not in runs:
                runs[elite.run_id] = store.run(elite.run_id)
            run = runs[elite.run_id]
        if study is not None and (run is None or run.study != study):
            continue
        if tune is not None and (run is None or not (run.study or "").startswith(f"{tune}/")):
            continue
        candidate = store.candidate(elite.identity)
        if candidate is None:  # the foreign key makes this impossible; say so if it happens
            raise ExportError(f"elite {elite.identity} has no candidate row in {_shown(store)}")
        workload = _workload_of(elite, run)
        if workload.kind not in EXPORTED_KINDS:
            continue
        if workload.problem() != candidate.problem:
            raise ExportError(f"elite {elite.identity} won {elite.workload_key}, whose problem "
                              f"{workload.problem()} is not the kernel's {candidate.problem}")
        found.append(Winner(elite, candidate, workload, run))
        taken.add(elite.workload_key)
    if not found:
        have = sorted({e.arch for e in store.elites()})
        studies = sorted({r.study for r in store.runs() if r.study and r.arch == arch.name})
        what = (f"{arch.name}" + (f" from study {study!r}" if study is not None else "")
                + (f" from tune {tune!r}" if tune is not None else ""))
        raise ExportError(f"the store has no elites for {what}; it has elites for "
                          f"{', '.join(have) or 'no arch'}"
                          + (f" (studies on {arch.name}: {', '.join(studies)})" if studies
                             else ""))
    return found


def kernel_specs(found: list[Winner], arch: Arch,
                 cover: bool = False) -> tuple[list[dict[str, Any]], list[Entry]]:
    """Compile each distinct winner for ``arch``; its spec (source, cubin, hashes, launch
    geometry) and one dispatch entry per workload it won. With ``cover``, also the entries
    ``derived_entries`` adds, so every (dtype, causal) of each tuned (kind, head dim) has
    a kernel."""
    records = {w.elite.identity: w.candidate for w in found}
    spaces: dict[str, SearchSpace] = {}
    built: dict[str, tuple[str, Candidate]] = {}  # stored identity -> (kernel name, candidate)
    for identity, rec in records.items():
        if rec.family not in spaces:
            try:
                spaces[rec.family] = SearchSpace.load(paths.SPACES / f"{rec.family}.toml")
            except ValueError as e:
                raise ExportError(f"elite {identity}: {e}") from None
        # A point stored before a parameter was added takes its legacy value (space.py).
        space = spaces[rec.family]
        won = {w.workload.kind for w in found if w.elite.identity == identity}
        if len(won) != 1 or not space.serves(next(iter(won))):
            raise ExportError(f"elite {identity} is a {'/'.join(space.kinds or (space.kind,))} "
                              f"kernel but won {', '.join(sorted(won))} workloads")
        try:
            cand = make_candidate(space, space.complete(rec.params), rec.problem, arch)
        except ValueError as e:
            raise ExportError(f"elite {identity} is not admitted for {arch.name}: {e}") from None
        # An elite of today's template (its identity is what today's template makes of its
        # stored parameters) is today's rendering of its completed point, named by that
        # point's identity: one kernel, whichever parameter layout stored it. An elite of an
        # older template is the kernel that was measured, built from its stored source.
        today = identity in (cand.identity, make_identity(rec.family, rec.problem, rec.params))
        built[identity] = (cand.identity if today else identity, cand)
    kernels: dict[str, tuple[str, Candidate]] = {}  # kernel identity -> (stored one, candidate)
    for identity, (name, cand) in built.items():
        kernels.setdefault(name, (identity, cand))
    named = [  # (kernel name, entry whose kernel index is set once the kernels are known)
        (built[w.elite.identity][0],
         Entry(kernel=-1, dtype=w.workload.dtype, head_dim=w.workload.head_dim,
               causal=w.workload.causal, seq_q=w.workload.seq_q,  # type: ignore[arg-type]
               seq_k=w.workload.seq_k, batch=w.workload.batch,  # type: ignore[arg-type]
               heads=w.workload.heads, median_us=w.elite.median_us,
               workload=w.elite.workload_key, kind=w.workload.kind))
        for w in found]
    derived: list[tuple[str, Entry]] = []
    if cover:
        by_name = {name: cand for name, (_, cand) in kernels.items()}
        for cand, entry in derived_entries(named, by_name, spaces, arch):
            kernels.setdefault(cand.identity, (cand.identity, cand))
            derived.append((cand.identity, entry))
    current = [cand for name, (_, cand) in kernels.items() if name == cand.identity]
    compiled = dict(zip((c.identity for c in current), compile_many(current, arch),
                        strict=True))
    derived_names = {name for name, _ in derived}
    kind_of = {name: e.kind for name, e in (*named, *derived)}  # the problem each kernel solves
    specs: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    for name, (identity, cand) in kernels.items():
        if name in compiled:
            source, result = render(cand), compiled[name]
        else:
            source = records[identity].source
            result = compile_source(source, arch, cand.defines(arch), identity=identity,
                                    smem_bytes=cand.smem_bytes)
        if not result.ok or result.cubin is None:
            if name in derived_names and identity not in records:
                continue  # its entries go; the tuned kernels still ship
            raise ExportError(f"elite {identity} does not compile for {arch.name}: "
                              f"{result.error}")
        index[name] = len(specs)
        specs.append({
            **cand.spec(), "name": name, "kind": kind_of[name], "defines": cand.defines(arch),
            "registers": result.registers, "spill_bytes": result.spill_bytes,
            "source": source, "source_sha256": sha256(source),
            "cubin": result.cubin, "cubin_sha256": sha256(result.cubin),
        })
    entries = [replace(e, kernel=index[name]) for name, e in (*named, *derived)
               if name in index]
    return specs, [e for kind in KINDS for group in dispatch_table(entries, kind).values()
                   for e in group]


def _source_key(have: list[tuple[tuple[str, Any], ...]],
                missing: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """Of the tuned variants (``(dimension, value)`` pairs), the one a missing variant is
    derived from: the fewest dimensions other than the dtype changed first (tiles are chosen
    for the masking or the layout), then the same dtype."""
    want = dict(missing)
    return min(have, key=lambda v: (sum(val != want[d] for d, val in v if d != "DTYPE"),
                                    dict(v)["DTYPE"] != want["DTYPE"]))


def derived_entries(named: list[tuple[str, Entry]], kernels: dict[str, Candidate],
                    spaces: dict[str, SearchSpace],
                    arch: Arch) -> list[tuple[Candidate, Entry]]:
    """For each (kind, head dim) the tuned entries hold, the variants they lack (every value
    of the kind's ``Problem.variants`` the family's space compiles: dtype and causal for the
    prefill kinds, dtype and paged for decode), each served by copies of the entries of the
    nearest tuned variant (``_source_key``): the same lengths, with that entry's kernel
    compiled for the missing variant (its parameters where admitted there, else the nearest
    admitted point: ``SearchSpace.nearest_admitted``). Such entries say ``tuned=False`` and
    name the entry they came from (``derived_from``); each comes with its kernel's candidate."""
    out: list[tuple[Candidate, Entry]] = []
    groups: dict[tuple[str, int], dict[tuple[tuple[str, Any], ...], list[tuple[str, Entry]]]] = {}
    domains: dict[tuple[str, int], dict[str, list[Any]]] = {}
    for name, e in named:
        dims = problem(e.kind).variants
        cand = kernels[name]
        space = spaces[cand.family]
        values = tuple((d, cand.problem[d]) for d in dims)
        groups.setdefault((e.kind, e.head_dim), {}).setdefault(values, []).append((name, e))
        domain = domains.setdefault((e.kind, e.head_dim), {d: [] for d in dims})
        for d in dims:  # every value some family of the kind compiles
            domain[d].extend(v for v in space.problem[d] if v not in domain[d])
    memo: dict[tuple[str, tuple[tuple[str, Any], ...]], Candidate | None] = {}
    for (kind, head_dim), by_values in groups.items():
        have = list(by_values)
        dims = problem(kind).variants
        for combo in itertools.product(*(domains[(kind, head_dim)][d] for d in dims)):
            values = tuple(zip(dims, combo, strict=True))
            if values in by_values:
                continue
            for name, src in by_values[_source_key(have, values)]:
                if (name, values) not in memo:
                    memo[(name, values)] = _derive(kernels[name], spaces, dict(values), arch)
                cand = memo[(name, values)]
                if cand is None:
                    continue
                there = (problem(kind).variant(workload_from_key(src.workload), dict(values))
                         .key() if src.workload else "")
                out.append((cand, replace(
                    src, dtype=cand.problem["DTYPE"],
                    causal=bool(dict(values).get("CAUSAL", src.causal)), median_us=None,
                    workload=there, tuned=False, derived_from=src.workload)))
    return out


def _derive(source: Candidate, spaces: dict[str, SearchSpace], values: dict[str, Any],
            arch: Arch) -> Candidate | None:
    space = spaces[source.family]
    compiled = {**source.problem, **values}
    params = space.nearest_admitted(source.params, compiled, arch)
    if params is None:
        return None
    return make_candidate(space, params, compiled, arch)


def namespace_of(specs: list[dict[str, Any]], entries: list[Entry], prefix: str) -> str:
    """A torch.library namespace named after what the module holds."""
    h = hashlib.sha256()
    for spec in specs:
        h.update(f"{spec['name']}:{spec['source_sha256']}:{spec['cubin_sha256']}\n".encode())
    for e in entries:
        h.update(json.dumps(asdict(e), sort_keys=True).encode())
    return f"{prefix}_{h.hexdigest()[:12]}"


def provenance(store: Store, arch: Arch, study: str | None, found: list[Winner],
               tune: str | None = None) -> dict[str, Any]:
    runs = {w.run.id: w.run for w in found if w.run is not None}
    return {
        "exporter": f"evoengine {__version__}",
        "commit": git_commit(),
        "exported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "store": _shown(store),
        "study": study if tune is None else f"{tune}/*",
        "arch": arch.name,
        "compiler": nvrtc_version(),
        "launcher_sha256": sha256(module_text()),
        "runs": [{"id": r.id, "study": r.study, "commit": r.commit, "device": r.device,
                  "started": r.created_at.isoformat(timespec="seconds"),
                  "workload": r.workload_key, "status": r.status}
                 for r in sorted(runs.values(), key=lambda r: r.id)],
    }


def load(store: str | os.PathLike[str] | None = DEFAULT_STORE, arch: Arch | str | None = None,
         study: str | None = None, *, tune: str | None = None,
         cover: bool = False) -> TunedAttention:
    """The exported module's ``attention``, built straight from the store, for ``arch``
    (default: the GPU present). ``store`` is named as ``Store`` names it (a path or a
    SQLAlchemy URL) and must exist; ``study``, ``tune`` and ``cover`` as for
    ``export_best``."""
    if arch is None:
        from evoengine.runtime import gpu_arch

        arch = gpu_arch()
    arch = get_arch(arch) if isinstance(arch, str) else arch
    with Store(store, create=False) as s:
        found = winners(s, arch, study, tune)
        prov = provenance(s, arch, study, found, tune)
    specs, entries = kernel_specs(found, arch, cover)
    kernels = [kernel_from_spec(spec, arch.name) for spec in specs]
    return TunedAttention(kernels, entries, namespace=namespace_of(specs, entries, "evoload"),
                          provenance=prov)


def import_module_file(path: str | os.PathLike[str], name: str | None = None) -> ModuleType:
    """Import an exported module from its file, as ``name`` (default: the file's stem),
    registered in ``sys.modules`` as an import would be (its dataclasses look their module up
    there): for tools and tests that hold a module's path rather than a place on sys.path."""
    import importlib.util
    import sys

    path = Path(path)
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ExportError(f"{path} is not a Python module file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# how a summary names each kind
_KIND_WORDS = {"bwd": "backward ", "varlen": "varlen ", "varlen_bwd": "varlen backward ",
               "decode": "decode "}


@dataclass(frozen=True)
class Exported:
    """What ``export_best`` wrote."""

    path: Path
    arch: str
    kernels: list[str]  # identities
    entries: list[Entry]

    def summary(self) -> str:
        keys = "; ".join(f"{_KIND_WORDS.get(kind, '')}{describe(key)} at sk "
                         + ", ".join(str(e.seq_k) for e in group)
                         for kind in KINDS
                         for key, group in dispatch_table(self.entries, kind).items())
        n, m = len(self.kernels), len(self.entries)
        return (f"wrote {self.path}: {n} kernel{'s' * (n != 1)} for {self.arch}, "
                f"{m} dispatch entr{'ies' if m != 1 else 'y'} ({keys})")


def export_best(store: str | os.PathLike[str] | None, arch: Arch | str, *, study: str | None = None,
                output: str | os.PathLike[str] = "tuned_attention.py", tune: str | None = None,
                cover: bool = False) -> Exported:
    """Write the module for ``arch`` from ``store`` (a path or a SQLAlchemy URL; it must
    exist): the winners of ``study``, or of the studies of the tune named ``tune``, or of
    all. With ``cover``, each tuned kernel is also compiled for the (dtype, causal) pairs of
    its head dim that nothing was tuned for (``derived_entries``), so every call of that
    head dim finds a kernel."""
    arch = get_arch(arch) if isinstance(arch, str) else arch
    out = paths.output_file(output, "module")
    with Store(store, create=False) as s:
        found = winners(s, arch, study, tune)
        prov = provenance(s, arch, study, found, tune)
    specs, entries = kernel_specs(found, arch, cover)
    text = render_module(specs, entries, prov)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return Exported(out, arch.name, [spec["name"] for spec in specs], entries)


# ---- the module's text ---------------------------------------------------------------------

def _string_literal(text: str) -> str:
    """The most readable Python literal of ``text``: raw triple-quoted where that is exact."""
    literal = repr(text)
    if "'''" not in text and not text.endswith("\\") and "\r" not in text:
        literal = f"r'''{text}'''"
    assert ast.literal_eval(literal) == text
    return literal




def _header(specs: list[dict[str, Any]], entries: list[Entry], prov: dict[str, Any]) -> str:
    lines = [
        f"Tuned attention kernels for {prov['arch']}, exported by {prov['exporter']}.",
        "",
        "    from tuned_attention import attention",
        "    out = attention(q, k, v, causal=False, scale=None)  # torch CUDA [B, H, S, D]",
        "    register_transformers()       # attn_implementation='evoengine' in Transformers",
        "    out = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,",
        "                           max_seqlen_k, causal=True)  # packed [total, H, D], if tuned",
        "    out = attention_decode(q, k_cache, v_cache, cache_seqlens, block_table=None)",
        "                                  # decode kernels, where the module has them",
        "",
        "Needs torch and cupy only. Each kernel's cubin for the target is embedded, so the first",
        "call does not compile; on another GPU its CUDA source (also embedded) is compiled",
        "there. Both are checked against their sha256 at import. A call with no tuned kernel",
        "raises NoKernelError, or runs torch SDPA with fallback='sdpa'.",
        "",
        "attention is differentiable in q, k and v (torch.autograd, torch.compile): its",
        "backward runs the backward kernel tuned nearest the call, listed below; where none",
        "fits, .backward() raises NoKernelError, or runs SDPA's backward with fallback='sdpa'.",
        "",
        f"store     {prov['store']}",
        f"study     {prov['study'] if prov['study'] is not None else '(all studies)'}",
        f"commit    {prov['commit'] or 'unknown'} (the exporting evoengine)",
        f"exported  {prov['exported_at']} with {prov['compiler']}",
    ]
    for r in prov["runs"]:
        lines.append(f"run {r['id']:<5} {r['started']}  {r['device'] or 'device unknown'}, "
                     f"commit {r['commit'] or 'unknown'}, study {r['study'] or '-'}")
    lines += ["", "Dispatch: the kernel tuned at the nearest (seq_q, seq_k), in log scale, then "
              "the nearest", "batch x heads among those; median us as measured by the search "
              "on the run's device:"]
    lines += ["Forward:", *_dispatch_lines(specs, entries, "fwd"), "Backward:",
              *(_dispatch_lines(specs, entries, "bwd") or ["  none"]),
              "Ragged batches (attention_varlen; lengths are the workload's longest):",
              *(_dispatch_lines(specs, entries, "varlen") or ["  none"])]
    ragged_backward = _dispatch_lines(specs, entries, "varlen_bwd")
    if ragged_backward:  # else attention_varlen's gradients are SDPA's, sequence by sequence
        lines += ["Ragged batches' backward (attention_varlen's gradients):", *ragged_backward]
    decode = _dispatch_lines(specs, entries, "decode")
    if decode:  # sq: q_len, sk: cache length (nearest cache length, then batch)
        lines += ["Decode (sq: q_len, sk: cache length):", *decode]
    return "\n".join(lines)


def _dispatch_lines(specs: list[dict[str, Any]], entries: list[Entry], kind: str) -> list[str]:
    lines = []
    for key, group in dispatch_table(entries, kind).items():
        derived = not all(e.tuned for e in group)
        lines.append(f"  {describe(key)}" + ("  (not tuned: kernels tuned for another dtype "
                                             "or mask, compiled for this one)" if derived
                                             else ""))
        for e in group:
            us = f"{e.median_us:9.1f} us" if e.median_us is not None else "         - us"
            lines.append(f"    sq {e.seq_q:<6} sk {e.seq_k:<6} {us}  {e.workload}"
                         + (f"  from {e.derived_from}" if not e.tuned else ""))
            lines.append(f"      {specs[e.kernel]['name']}")
    return lines


def render_module(specs: list[dict[str, Any]], entries: list[Entry],
                  prov: dict[str, Any]) -> str:
    """The exported module's source text."""
    namespace = namespace_of(specs, entries, "evoengine")
    parts = [
        f'"""{_header(specs, entries, prov)}\n"""\n',
        "from __future__ import annotations\n",
        f"# ---- launcher: evoengine/launch/ (sha256 {prov['launcher_sha256'][:16]}), its "
        "modules joined verbatim ----\n",
        module_text(),
        "\n# ---- this export ----------------------------------------------------------------\n",
        f"ARCH = {prov['arch']!r}",
        f"PROVENANCE = {pprint.pformat(prov, width=96, sort_dicts=False)}",
        "DISPATCH = [",
        *(f"    {e!r}," for e in entries),
        "]",
        "",
    ]
    for i, spec in enumerate(specs):
        parts += [f"_SOURCE_{i} = {_string_literal(spec['source'])}",
                  f'_CUBIN_{i} = """\n{pack_cubin(spec["cubin"])}"""', ""]
    parts.append("_KERNEL_SPECS = [")
    for i, spec in enumerate(specs):
        parts.append(f"    dict(source=_SOURCE_{i}, cubin=_CUBIN_{i},")
        parts += [f"         {k}={v!r}," for k, v in spec.items() if k not in ("source", "cubin")]
        parts.append("         ),")
    parts += [
        "]",
        "",
        "attention = TunedAttention([kernel_from_spec(s, ARCH) for s in _KERNEL_SPECS], DISPATCH,",
        f"                           namespace={namespace!r}, provenance=PROVENANCE)",
        "attention_varlen = attention.varlen",
        "register_transformers = attention.register_transformers",
        "# decode over a KV cache: the entries of kind decode (evoengine/launch/decode.py)",
        "attention_decode = TunedDecode(attention.kernels, DISPATCH)",
        "",
        '__all__ = ["DISPATCH", "PROVENANCE", "IntegrityError", "NoKernelError", "attention",',
        '           "attention_varlen", "attention_decode", "register_transformers"]',
        "",
    ]
    return "\n".join(parts)
