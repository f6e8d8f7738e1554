"""What a problem is: the contract every kind of attention call implements.

A **problem** is one way attention is called (the forward today; the backward, ragged
prefill and decode next). It declares everything the pipeline needs to know about that call
and nothing about how a kernel schedules it:

- its workload type (the shape of one call: what a search is for, what the store keys on),
  with the dimensions compiled into a kernel (``Workload.problem()``: a space's
  ``[problem]`` table), its key (``Workload.key()``) and its FLOP count;
- the command-line flags that name a workload;
- its correctness criterion (defined in ``evoengine.validate``, applied by ``check``);
- the inputs a kernel is timed on, how a loaded kernel is called on them, and the anchors
  (SDPA's backends) timed next to it in the same process;
- how a compiled candidate is loaded for the GPU.

A search space names its problem with ``kind = "..."`` (``"fwd"`` where absent), so a
search, a store row, a replay record and an exported entry all say which problem they are
of. Adding a kind is a module under ``evoengine/problems/`` plus its templates and spaces:
register it in ``evoengine/problems/__init__.py``.

Contract: implementations are stateless singletons. ``check`` returns a ``Verdict`` and
never raises for a wrong answer (a fault, a CUDA error, is the caller's to catch);
``workload_from_*`` raise ``ValueError`` with a one-line message for bad input; nothing here
mutates the workload (workloads are frozen dataclasses).
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from evoengine.workload import DEFAULT_KIND

if TYPE_CHECKING:
    from evoengine.compile import CompileResult
    from evoengine.geometry import ModelGeometry
    from evoengine.measure import Timing
    from evoengine.render import Candidate
    from evoengine.validate import Verdict

__all__ = ["DEFAULT_KIND", "Problem", "Rate", "TimedCall", "Workload"]


class Workload(Protocol):
    """What every problem's workload provides (frozen dataclasses in practice)."""

    kind: ClassVar[str]
    dtype: str

    @property
    def kv_group(self) -> int: ...  # query heads per KV head
    def key(self) -> str: ...
    def problem(self) -> dict[str, object]: ...
    def flops(self) -> float: ...
    def to_dict(self) -> dict[str, object]: ...


TimedCall = Callable[[int], None]  # fn(i): one call on input set i, as measure.time_calls takes


@dataclasses.dataclass(frozen=True)
class Rate:
    """How fast a call of ``us`` microseconds went, as its kind counts it: ``per_us / us``
    in ``unit`` (matrix TFLOPS for attention; bytes per second where a kind is
    memory-bound, as decode is)."""

    per_us: float
    unit: str = "TFLOPS"

    def __call__(self, us: float) -> float:
        return self.per_us / us

    @classmethod
    def tflops(cls, flops: float) -> Rate:
        return cls(flops / 1e6, "TFLOPS")


class Problem(abc.ABC):
    """One kind of attention call; see the module docstring."""

    kind: ClassVar[str]
    summary: ClassVar[str]
    anchors: ClassVar[tuple[str, ...]] = ()  # what a kernel is timed next to, same process
    # The compiled dimensions (of its families' ``[problem]``) whose every value a model's
    # calls of this kind take besides the head dim: ``export --cover`` derives a kernel for
    # each value a tune did not search (``variant``).
    variants: ClassVar[tuple[str, ...]] = ("DTYPE", "CAUSAL")

    # ---- workloads -----------------------------------------------------------------------

    @abc.abstractmethod
    def method(self) -> str:
        """How a search's results of this kind were timed, for the header of its results
        JSON (``provenance.header``): the timing, the anchors and how they were called."""

    @abc.abstractmethod
    def workload_from_dict(self, data: Mapping[str, Any]) -> Workload:
        """The workload ``to_dict()`` wrote (the store's run rows, replay records)."""

    @abc.abstractmethod
    def workload_from_key(self, key: str) -> Workload:
        """The workload ``key()`` names; ``ValueError`` if ``key`` is not one of this kind."""

    def rate(self, workload: Any) -> Rate:
        """The rate a search, a tune and a report show for a time on ``workload``."""
        return Rate.tflops(workload.flops())

    def variant(self, workload: Any, values: Mapping[str, Any]) -> Workload:
        """``workload`` with the compiled dimensions of ``values`` (names of ``variants``)."""
        return dataclasses.replace(workload, dtype=values["DTYPE"], causal=values["CAUSAL"])

    def tune_workloads(self, geometry: ModelGeometry) -> list[Workload]:
        """The calls of this kind a model of ``geometry`` makes, for ``evoengine tune``
        (``evoengine.tune``). By default its prefills (``ModelGeometry.prefill_calls``: a
        log ladder of lengths, ~16K tokens per call) as workloads of this kind; a kind whose
        calls are shaped otherwise (decode, ragged batches) says which of its own."""
        return [self.workload_from_dict(call) for call in geometry.prefill_calls()]

    def cell_workloads(self, workload: Any) -> list[Workload]:
        """Calls off the tune's ladder that an exported entry tuned on ``workload`` serves
        (the dispatch's nearest-length cell), for the tune's cross re-time
        (``evoengine.search.cross``); none by default: the kind's entries are not chosen
        across their cells."""
        return []

    @abc.abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser | Any) -> None:
        """The command-line flags that name a workload of this kind."""

    @abc.abstractmethod
    def workload_from_arguments(self, args: argparse.Namespace) -> Workload:
        """The workload the flags of ``add_arguments`` name; ``ValueError`` if they name none."""

    # ---- on the GPU ----------------------------------------------------------------------

    @abc.abstractmethod
    def load(self, candidate: Candidate, compiled: CompileResult) -> Any:
        """The compiled candidate, loaded on the current CUDA device and ready to call."""

    @abc.abstractmethod
    def check(self, kernel: Any, workload: Any, *, device: str = "cuda") -> Verdict:
        """The criterion of ``evoengine.validate`` for this kind, on every shape it plans."""

    def graph_for(self, workload: Any) -> bool:
        """Whether every contender of ``workload`` is timed by CUDA-graph replay."""
        from evoengine import measure

        return measure.graph_for(workload)

    @abc.abstractmethod
    def inputs(self, workload: Any, device: str | int = "cuda") -> Sequence[tuple[Any, ...]]:
        """Input sets for timing, enough of them to rotate past L2."""

    @abc.abstractmethod
    def timed_call(self, kernel: Any, workload: Any,
                   sets: Sequence[tuple[Any, ...]]) -> TimedCall:
        """``fn(i)``: the loaded kernel on input set ``i``."""

    @abc.abstractmethod
    def time_anchor(self, anchor: str, workload: Any, sets: Sequence[tuple[Any, ...]],
                    **timing: Any) -> Timing | None:
        """Time ``anchor`` (one of ``anchors``) on the sets as ``measure.time_calls`` would
        (``timing`` is its keywords); None where that anchor cannot run the workload here."""
