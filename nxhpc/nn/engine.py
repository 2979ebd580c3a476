"""The model-agnostic engine: ONE arena and ONE forked pool running stage-table plans.

Owns :class:`Stage` (one parallel stage: a name, the extent it is split over, its timing key,
its task and its formula), :class:`Plan` (what a family's block plan must answer: its config,
stages, extents, scratch shapes, the inputs it reads, how its weights are checked and how a
worker's context is built) and :class:`Engine`: it sizes ONE
:class:`~nxhpc.runtime.shm.SharedArena` for every ``(plan, tokens)`` it is told it will run
(flat scratch per name, sized for the largest need), holds the caller's named buffers and the
family's state buffers, checks and types every block's weights in the parent, forks ONE
:class:`~nxhpc.runtime.workers.WorkerPool` after that, and runs any of those plans on views of
its buffers: workers find buffers by name and row range, never by pointer; and
:class:`EngineSession`, the base of a family's session holding one engine.
Must not: know any model family (``nxhpc.dit``, ``nxhpc.qwen3``: their plans say what a stage
does), parse files, or compute anything itself (the stages' tasks call ``nxhpc._kernels``).

A run: :meth:`Engine.run_plan` maps each input view to ``(buffer, r0, r1)``, checks the scratch
sizing, and sends the workers one small hashable tuple per stage (the "wire"); a worker turns
it into the plan's context once (cached) and runs the stage's task on its band
``[i*m//n, (i+1)*m//n)``. Every kernel is band-invariant, so a plan whose tasks only call
kernels gives bit-identical outputs for every worker count. Consecutive stages the plan calls
row-local for the run (:meth:`Plan.row_local`) are sent as one command (:data:`ROW_GROUPS`):
each worker runs its band of each in turn, with no wait between them.

Ranks. Under ``mpirun -n R`` (:func:`nxhpc.runtime.ranks.init_world` called by the CLI) every
rank maps the weights and builds its own engine, arena and pool; a stage its plan splits across
ranks (:meth:`Plan.split` returns the :class:`Gather` regions it writes) runs rank ``r``'s band
``[r*m//R, (r+1)*m//R)`` of its extent, split again over that rank's W workers, and after it
the ranks gather those regions into every rank's copy of the buffers (in-place ``Allgatherv``
of row bands, or of column bands packed through a scratch); a stage the plan does not split
(:meth:`Plan.split` returns None: the default, so any plan is correct under mpirun) runs whole
on every rank, with no exchange. The bands are the same bands, so the bits are those of one
process with any W. Extra tasks (:meth:`Engine.run_task`) run whole on every rank. With one
rank (no launcher, ``ranks=False``) nothing of this runs and MPI is never imported.
"""
from __future__ import annotations

import functools
import math
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

import nxhpc
from nxhpc.formats.closing import Closing
from nxhpc.nn.linear import check_runnable
from nxhpc.runtime import ranks as _ranks
from nxhpc.runtime.shm import SharedArena
from nxhpc.runtime.workers import DEFAULT_SPAWN, SPAWN_MODES, WorkerPool, check_timeout

__all__ = ["Stage", "Plan", "Engine", "arena_layout", "EngineSession", "RunContext", "BufRef",
           "IOSpec", "Gather", "StageSplit", "TOTAL_KEY", "timing_keys", "stage_table",
           "serialized"]

#: The timing key of a whole plan run (every stage), after the stages' own keys.
TOTAL_KEY = "block_us"

#: Consecutive row-local stages (:meth:`Plan.row_local`) of a run on one process (no MPI
#: ranks) go to the workers as one dispatch: each worker runs its band of each in turn, with
#: no wait for the others between them, since its band reads only rows it wrote itself. The
#: bands are the ones each stage would get alone, so no bit changes; a group saves each
#: later stage's dispatch, wake-ups and wait for the slowest band. False: every stage alone.
ROW_GROUPS = True

#: The pool task that runs a row group (its arg: the run's wire and the stage names).
GROUP_TASK = "_row_group"


class StageSplit(NamedTuple):
    """Where one stage's time went in the last run (:attr:`Engine.last_split`), nanoseconds:
    ``wall`` the parent's dispatch-to-collected time (the exchange between ranks excluded), and
    per band the task's own time (:attr:`WorkerPool.last_busy_ns`): ``busy_max`` (the slowest
    band, which the stage waits for) and ``busy_min``. ``wall - busy_max`` is the pool's cost
    (writing the commands, waking the workers, collecting the results); ``busy_max - busy_min``
    what an unequal split costs. ``extent``: the ``m`` whose ``[0, m)`` the bands split (a
    projection's output columns, or its token rows: :func:`nxhpc.nn.stages.proj_by_rows`).
    ``group``: for a stage run in a row group (:data:`ROW_GROUPS`), the first stage of its
    group, else ``""``. Its ``busy_max`` / ``busy_min`` are then its own bands', and its
    ``wall`` is its share of the slowest band's time for the whole group (in proportion to its
    ``busy_max``), the group's first stage adding what the wall took beyond that: so
    ``overhead`` summed over a group is the pool's cost of the group, while ``busy_max -
    busy_min`` summed over it overstates what its unequal bands cost (a band does not wait for
    the others between the stages of a group)."""
    name: str
    wall: int
    busy_max: int
    busy_min: int
    extent: int = 0
    group: str = ""

    @property
    def overhead(self) -> int:
        """``wall - busy_max`` (at least 0): the pool's cost of this stage, nanoseconds."""
        return max(0, self.wall - self.busy_max)


class Stage(NamedTuple):
    """One parallel stage: ``name`` (worker task and error label), ``extent`` (a key of the
    plan's extents), ``timer`` (timing key), ``task(ctx, lo, hi)``, ``doc`` (its formula; one
    line each where it computes several things)."""
    name: str
    extent: str
    timer: str
    task: Callable[[Any, int, int], None]
    doc: str


class IOSpec(NamedTuple):
    """One input/output of a plan run: its shape at ``T`` tokens, dtype, and whether a run may
    omit it (the context then sees None)."""
    shape: tuple[int, ...]
    dtype: Any = np.float32
    optional: bool = False


class Gather(NamedTuple):
    """What a stage split across ranks wrote, to be gathered after it: buffer ``name`` (an io
    name of the run or a scratch name) viewed as ``shape`` ``[rows, cols]`` (C order), where
    band ``[lo, hi)`` of the stage's extent wrote indices ``[offset + lo*unit, offset +
    hi*unit)`` of ``axis`` (0: rows, 1: columns), clipped to ``[0, shape[axis])``."""
    name: str
    shape: tuple[int, int]
    axis: int = 0
    offset: int = 0
    unit: int = 1

    def bounds(self, band: tuple[int, int]) -> tuple[int, int]:
        """The index range of ``axis`` that stage band ``band`` wrote."""
        n = self.shape[self.axis]
        a = min(n, max(0, self.offset + band[0] * self.unit))
        b = min(n, max(0, self.offset + band[1] * self.unit))
        return a, max(a, b)


class BufRef(NamedTuple):
    """Rows ``[r0, r1)`` of arena buffer ``name`` (how a view travels to the workers)."""
    name: str
    r0: int
    r1: int


class RunContext:
    """Base of the per-run context a family's plan builds for its tasks: subclasses declare
    ``__slots__``; :meth:`release` drops every one of them (views of the arena included)."""
    __slots__ = ()

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)

    def release(self) -> None:
        for cls in type(self).__mro__:
            for name in getattr(cls, "__slots__", ()):
                setattr(self, name, None)


def timing_keys(stages: Iterable[Stage]) -> tuple[str, ...]:
    """The stages' timing keys in first-use order, then :data:`TOTAL_KEY`."""
    keys: list[str] = []
    for s in stages:
        if s.timer not in keys:
            keys.append(s.timer)
    return tuple(keys) + (TOTAL_KEY,)


def stage_table(stages: Iterable[Stage], extent_names: Mapping[str, str]) -> str:
    """A plan's stage table as its module docstring shows it (``extent_names``: extent key ->
    what it splits over)."""
    rows = [("stage", "split over", "timer", "task")]
    for s in stages:                    # a formula's later lines under its first
        first, *more = s.doc.split("\n")
        rows.append((s.name, extent_names[s.extent], s.timer, first))
        rows += [("", "", "", line) for line in more]
    return "\n".join(f"{a:<12} {b:<18} {c:<15} {d}".rstrip() for a, b, c, d in rows)


class Plan:
    """What an :class:`Engine` needs from a family's block plan (subclasses: the DiT's
    ``BlockPlan``, the Qwen3 ``LayerPlan``). A plan holds no memory and no processes.

    Attributes: ``config`` (compared with ``==``: one engine serves one config), ``stages``
    (tuple of :class:`Stage`), ``label`` (names the plan in messages).
    """
    config: Any
    stages: tuple[Stage, ...]

    @property
    def label(self) -> str:
        return type(self).__name__

    @property
    def timing_keys(self) -> tuple[str, ...]:
        return timing_keys(self.stages)

    def extent(self, stage: Stage, T: int, params: tuple | None = None) -> int:
        """The ``m`` of ``stage`` at ``T`` tokens (its bands split ``[0, m)``) in a run with
        ``params`` (None: the stage's own extent, as the split across ranks uses)."""
        raise NotImplementedError

    def row_local(self, stage: Stage, params: tuple) -> bool:
        """Whether ``stage``, in a run with ``params``, splits over the run's token rows and
        its band ``[lo, hi)`` reads only rows ``[lo, hi)`` of what earlier stages wrote and
        writes only those rows. Consecutive such stages run as one dispatch (each worker goes
        on to the next with no wait: :data:`ROW_GROUPS`). Default: False for every stage."""
        return False

    def scratch(self, T: int) -> dict[str, tuple[int, ...]]:
        """Scratch buffer shapes (float32) of a run at ``T`` tokens."""
        raise NotImplementedError

    def split(self, stage: Stage, T: int) -> tuple[Gather, ...] | None:
        """How ``stage`` runs across MPI ranks at ``T`` tokens: None (the default) -- whole on
        every rank, no exchange -- or the :class:`Gather` regions its band writes that later
        stages read beyond that band: each rank then runs its rank band and the regions are
        gathered after the stage. A region the plan leaves out stays partial on each rank, so
        it must only be read band by band with the same split afterwards."""
        return None

    def io(self, T: int) -> dict[str, IOSpec]:
        """The views a run at ``T`` tokens reads and writes, by name."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """Family state buffers (``SharedArena`` specs) every run of this config may read."""
        return {}

    def init_state(self, views: Mapping[str, np.ndarray]) -> None:
        """Fill the state buffers once, before the fork."""

    def bind(self, key: Hashable, weights: Any, kernels: Any) -> Any:
        """``weights`` checked against the config and typed (matrices as WeightTensor, no
        copy); raise naming the tensor. Called once per block, in the parent."""
        raise NotImplementedError

    def matrices(self, weights: Any) -> dict[str, Any]:
        """The bound block's matrices by short name (each checked runnable by the kernels)."""
        raise NotImplementedError

    def context(self, kernels: Any, weights: Any, T: int, buf: Mapping[str, np.ndarray],
                io: Mapping[str, np.ndarray | None], state: Mapping[str, np.ndarray],
                params: tuple) -> RunContext:
        """The context every task of one run reads (built once per process and run)."""
        raise NotImplementedError


def serialized(method: Callable[..., Any]) -> Callable[..., Any]:
    """An Engine method run under the engine's lock (one call at a time, across threads)."""
    @functools.wraps(method)
    def run_serialized(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        lock = self._lock
        if lock is None:                    # __init__ never got that far
            raise RuntimeError(f"Engine.{method.__name__}: the engine is closed")
        with lock:
            return method(self, *args, **kwargs)
    return run_serialized


def arena_layout(needs: Iterable[tuple[Plan, int]], buffers: Mapping[str, Any] | None = None
                 ) -> tuple[dict[str, Any], dict[str, int], list[str]]:
    """The buffers of an :class:`Engine`'s arena for ``needs`` (``(plan, T)`` pairs) and the
    caller's ``buffers``: flat scratch sized for the largest need, the plans' state, the
    caller's. Returns ``(spec, scratch elements by name, state names)``; ValueError on a name
    that two of them claim. ``nxhpc.runtime.shm.arena_bytes(spec)`` is the arena's size, known
    before anything is built."""
    plans: list[Plan] = []
    cap: dict[str, int] = {}
    for p, T in needs:
        if not any(p is q for q in plans):
            plans.append(p)
        for n, shape in p.scratch(int(T)).items():
            cap[n] = max(cap.get(n, 0), math.prod(shape))
    spec: dict[str, Any] = {n: (c,) for n, c in cap.items()}
    state_names: list[str] = []
    for p in plans:
        for n, s in p.state().items():
            if n in spec and n not in state_names:
                raise ValueError(f"Engine: state buffer {n!r} clashes with a scratch name")
            spec[n] = s
            if n not in state_names:
                state_names.append(n)
    for n, s in (buffers or {}).items():
        if n in spec:
            raise ValueError(f"Engine: buffer name {n!r} is reserved (scratch: "
                             f"{', '.join(spec)})")
        spec[n] = s
    return spec, cap, state_names


class Engine:
    """ONE arena and ONE forked pool serving several plans (of one config) at several token
    counts.

    ``needs``: the ``(plan, T)`` pairs that will run (scratch is sized for the largest).
    ``weights``: ``{key: weights}`` -- every block's weights, bound before the fork (checked and
    typed by the plan's :meth:`Plan.bind`). ``buffers``: the caller's arena buffers
    (``SharedArena`` specs); a run's inputs/outputs are row ranges of them (:meth:`buffer`),
    so a plan can run on part of a joint buffer in place. ``workers`` / ``spawn`` /
    ``stage_timeout`` as for :class:`~nxhpc.runtime.workers.WorkerPool` (``stage_timeout`` also
    bounds each exchange between ranks). ``ranks``: a :class:`~nxhpc.runtime.ranks.Ranks` to
    split the plans' stages across, None for the active world (:func:`nxhpc.runtime.ranks.world`:
    none on one rank), False for this process alone. ``tasks``: extra named
    worker tasks ``fn(engine, lo, hi, arg)`` beside the stages (a model's embedders, its final
    layer), forked with the pool and run by :meth:`run_task`; in a worker ``engine`` is that
    process's engine (:meth:`buffer` works).

    Threads: one engine runs one call at a time (:meth:`run_plan` and :meth:`close` hold a
    lock). Lifetime: ``close()`` (or ``with``) releases the workers and the arena at once; an
    engine dropped without it (or whose ``__init__`` was interrupted) is released when its last
    reference goes -- it holds no reference cycle.
    """

    #: The plan class this engine runs (a family's engine narrows it).
    plan_type: type = Plan

    # Defaults at class level: an engine whose __init__ raised (or was interrupted) early still
    # answers every attribute close() and the properties read.
    pool: WorkerPool | None = None
    arena: SharedArena | None = None
    _ctx: dict = {}
    _views: dict = {}
    _lock: Any = None

    def __init__(self, needs: Iterable[tuple[Plan, int]], weights: Mapping[Hashable, Any], *,
                 buffers: Mapping[str, Any] | None = None, workers: int = 1,
                 spawn: str = DEFAULT_SPAWN, stage_timeout: float | None = None,
                 tasks: Mapping[str, Callable[["Engine", int, int, Any], None]] | None = None,
                 ranks: Any = None) -> None:
        extra_tasks = dict(tasks or {})
        needs = [(p, int(T)) for p, T in needs]
        if not needs:
            raise ValueError("Engine: needs no (plan, T) pairs")
        for p, T in needs:
            if not isinstance(p, self.plan_type):
                raise TypeError(f"Engine: needs must be ({self.plan_type.__name__}, T) pairs, "
                                f"got {type(p).__name__}")
            if T < 1:
                raise ValueError(f"Engine: token count must be >= 1, got {T}")
        cfg = needs[0][0].config
        if any(p.config != cfg for p, _ in needs):
            raise ValueError(f"Engine: every plan of one engine must share one "
                             f"{type(cfg).__name__}")
        if spawn not in SPAWN_MODES:
            raise ValueError(f"spawn must be one of {SPAWN_MODES}, got {spawn!r}")
        stage_timeout = check_timeout(stage_timeout)
        if ranks is None:
            ranks = _ranks.world()
        self.ranks = ranks if ranks and ranks.size > 1 else None
        self.stage_timeout = stage_timeout
        #: cumulative exchange between ranks: microseconds waited and bytes received
        self.exchange_us = 0
        self.exchange_bytes = 0
        #: the last run's stages: where their time went (:class:`StageSplit`)
        self.last_split: tuple[StageSplit, ...] = ()
        self._lock = threading.RLock()
        self.config = cfg
        self.needs = needs
        self.kernels = nxhpc.kernels()
        self._plans: list[Plan] = []
        for p, _ in needs:
            if not any(p is q for q in self._plans):
                self._plans.append(p)
        first = self._plans[0]
        # weights: checked and typed once, in the parent, before the fork
        self._weights: dict[Hashable, Any] = {}
        self._given: dict[Hashable, Any] = {}
        self._by_id: dict[int, Hashable] = {}
        for key, w in weights.items():
            typed = first.bind(key, w, self.kernels)
            for m in first.matrices(typed).values():
                check_runnable(self.kernels, m)
            self._weights[key] = typed
            self._given[key] = w         # held, so id(w) cannot be reused while we map it
            self._by_id[id(w)] = key
        # tasks: the union of the plans' stage tables (one task per stage name)
        task_fns: dict[str, Callable[[int, int, Any], None]] = {}
        seen: dict[str, Stage] = {}
        for p in self._plans:
            for s in p.stages:
                if s.name in seen and seen[s.name].task is not s.task:
                    raise ValueError(f"Engine: two plans define stage {s.name!r} differently")
                seen[s.name] = s
                task_fns[s.name] = self._task(s.task)
        task_fns[GROUP_TASK] = self._group_task({n: st.task for n, st in seen.items()})
        self._extra: dict[str, Callable[..., None]] = {}
        for name, fn in extra_tasks.items():
            if name in seen or name == GROUP_TASK or not callable(fn):
                raise ValueError(f"Engine: extra task {name!r} must be a callable whose name is "
                                 f"not a stage's ({', '.join(seen)}) nor {GROUP_TASK!r}")
            self._extra[name] = fn
            task_fns[name] = self._extra_task(fn)
        spec, self._cap, self._state_names = arena_layout(needs, buffers)
        self._user = list(buffers or {})
        self._splits: dict[tuple[int, str, int], tuple[Gather, ...] | None] = {}
        if self.ranks is not None:
            for p, T in needs:
                for s in p.stages:
                    self._splits[(self._plans.index(p), s.name, T)] = self._check_split(p, s, T)
        self._ctx: dict[tuple, RunContext] = {}
        self._views: dict[tuple, dict[str, np.ndarray]] = {}
        try:
            # If an interrupt lands between a constructor's return and the store, the object is
            # dropped at once and its own finalizer releases it (see the class docstring).
            self.arena = a = SharedArena(spec)
            self._v = {n: a[n] for n in a}
            self._state = {n: self._v[n] for n in self._state_names}
            for p in self._plans:
                p.init_state(self._state)
            self._addr = {n: (buf.__array_interface__["data"][0], buf)
                          for n, buf in self._v.items() if n in self._user}
            # The bf16 attention's dot is chosen once per process by timing two peak loops
            # (nx_attn_bf16.h): choose it before the fork, so every worker inherits one choice
            # (the same bits either way) instead of each timing its own, per stage under "stage".
            nxhpc.kernels().attention_bf16_dot()
            self.pool = WorkerPool(workers, task_fns, mode=spawn, stage_timeout=stage_timeout,
                                   warm=a.populate)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check_split(plan: Plan, stage: Stage, T: int) -> tuple[Gather, ...] | None:
        """``plan.split(stage, T)``, each region checked against the plan's buffers."""
        split = plan.split(stage, T)
        if split is None:
            return None
        sizes = {n: math.prod(s) for n, s in plan.scratch(T).items()}
        sizes.update({n: math.prod(io.shape) for n, io in plan.io(T).items()})
        for g in split:
            if not isinstance(g, Gather) or g.axis not in (0, 1) or len(g.shape) != 2:
                raise ValueError(f"Engine: {plan.label} stage {stage.name!r}: a split must be "
                                 f"Gather regions with a 2-D shape and axis 0 or 1, got {g!r}")
            if g.name not in sizes or sizes[g.name] != math.prod(g.shape):
                raise ValueError(f"Engine: {plan.label} stage {stage.name!r} gathers "
                                 f"{g.name!r} as {g.shape}, which is not one of the plan's "
                                 f"buffers at T={T} ({sorted(sizes)})")
        return tuple(split)

    def rank_bands(self, plan: Plan, T: int) -> dict[str, list[tuple[int, int]] | None]:
        """Stage name -> every rank's band of its extent at ``T`` tokens (None: whole on every
        rank). Empty on one rank."""
        if self.ranks is None:
            return {}
        index = self._plan_index(plan)
        return {s.name: None if self._splits.get((index, s.name, T)) is None
                else self.ranks.bounds(plan.extent(s, T)) for s in plan.stages}

    def _exchange(self, index: int, T: int, wire: tuple, stage: Stage, m: int,
                  split: tuple[Gather, ...]) -> None:
        """After rank-split ``stage``: gather each region of ``split`` into every rank."""
        refs = dict(wire[4])
        ranks = self.ranks
        bounds = ranks.bounds(m)
        for g in split:
            r = refs.get(g.name)
            a = self._v[r[0]][r[1]:r[2]] if r is not None \
                else self._scratch_views(index, T)[g.name]
            a = a.reshape(g.shape)
            bs = [g.bounds(b) for b in bounds]
            what = f"the exchange of {g.name!r} after stage {stage.name!r}"
            if g.axis == 0:
                ranks.gather_rows(a, bs, what, self.stage_timeout)
                per = a.nbytes // g.shape[0]
            else:
                ranks.gather_cols(a, bs, what, self.stage_timeout)
                per = a.nbytes // g.shape[1]
            lo, hi = bs[ranks.rank]
            self.exchange_bytes += per * (sum(b - a_ for a_, b in bs) - (hi - lo))

    # -- worker side
    def _task(self, fn: Callable[[Any, int, int], None]) -> Callable[[int, int, Any], None]:
        # A weak reference: the pool holds the tasks, so a strong one would make engine -> pool
        # -> task -> engine a cycle, and an engine dropped without close() (an interrupt between
        # Engine() returning and the caller's store) would keep its workers and arena until the
        # cyclic garbage collector happened to run. Workers run inside the frame that forked
        # them, where the engine is alive.
        ref = weakref.ref(self)

        def run_band(lo: int, hi: int, wire: tuple) -> None:
            engine = ref()
            if engine is None:
                raise RuntimeError("Engine: the engine was released while its workers ran")
            fn(engine._context(wire), lo, hi)
        return run_band

    def _group_task(self, fns: Mapping[str, Callable[[Any, int, int], None]]
                    ) -> Callable[[int, int, Any], tuple[int, ...]]:
        """The task of a row group: ``arg`` = (wire, stage names); runs each stage's task on
        the band in turn and returns each one's nanoseconds. An error names its stage."""
        ref = weakref.ref(self)

        def run_group(lo: int, hi: int, arg: tuple) -> tuple[int, ...]:
            engine = ref()
            if engine is None:
                raise RuntimeError("Engine: the engine was released while its workers ran")
            wire, names = arg
            c = engine._context(wire)
            now = time.perf_counter_ns
            spent = []
            for name in names:
                t0 = now()
                try:
                    fns[name](c, lo, hi)
                except BaseException as e:
                    e.add_note(f"in stage {name!r} of the row group {'+'.join(names)}")
                    raise
                spent.append(now() - t0)
            return tuple(spent)
        return run_group

    def _extra_task(self, fn: Callable[["Engine", int, int, Any], None]
                    ) -> Callable[[int, int, Any], None]:
        ref = weakref.ref(self)

        def run_band(lo: int, hi: int, arg: Any) -> None:
            engine = ref()
            if engine is None:
                raise RuntimeError("Engine: the engine was released while its workers ran")
            fn(engine, lo, hi, arg)
        return run_band

    def _scratch_views(self, index: int, T: int) -> dict[str, np.ndarray]:
        views = self._views.get((index, T))
        if views is None:
            views = {n: self._v[n][:math.prod(s)].reshape(s)
                     for n, s in self._plans[index].scratch(T).items()}
            self._views[(index, T)] = views
        return views

    def _context(self, wire: tuple) -> RunContext:
        """The plan's context of one run (built once per process and run, then cached).
        ``wire`` = (plan index, weights key, T, params, ((io name, BufRef tuple | None), ...))."""
        c = self._ctx.get(wire)
        if c is None:
            index, key, T, params, refs = wire
            views = self._v
            io = {n: None if r is None else views[r[0]][r[1]:r[2]] for n, r in refs}
            plan = self._plans[index]
            c = plan.context(self.kernels, self._weights[key], T, self._scratch_views(index, T),
                             io, self._state, params)
            self._ctx[wire] = c
        return c

    # -- parent side
    def buffer(self, name: str) -> np.ndarray:
        """The caller's arena buffer ``name`` (a writeable view; shared with the workers)."""
        if self.closed:
            raise RuntimeError(f"Engine.buffer: the engine is closed (buffer {name!r})")
        if name not in self._user:
            raise KeyError(f"Engine: no buffer {name!r} (buffers: {', '.join(self._user)})")
        return self._v[name]

    def ref(self, what: str, view: Any, shape: tuple[int, ...], dtype: Any) -> BufRef:
        """Which arena buffer and rows ``view`` is; ValueError unless it is whole rows of one."""
        if not isinstance(view, np.ndarray) or view.dtype != dtype or view.shape != shape:
            got = f"{view.dtype} {view.shape}" if isinstance(view, np.ndarray) \
                else type(view).__name__
            raise ValueError(f"Engine.run: {what} must be {np.dtype(dtype)} {shape}, got {got}")
        p = view.__array_interface__["data"][0]
        for name, (base, buf) in self._addr.items():
            if buf.shape[1:] != shape[1:] or buf.dtype != view.dtype:
                continue
            row = buf.strides[0]
            off = p - base
            if 0 <= off < buf.nbytes and off % row == 0 and view.flags.c_contiguous:
                r0 = off // row
                if r0 + shape[0] <= buf.shape[0]:
                    return BufRef(name, int(r0), int(r0 + shape[0]))
        raise ValueError(f"Engine.run: {what} must be a row range of one of the engine's "
                         f"buffers ({', '.join(self._user) or 'none declared'}), with their "
                         f"trailing shape: workers reach buffers by name")

    def weights_key(self, weights: Any) -> Hashable:
        """The registry key of ``weights`` (a key, or a registered weights object)."""
        key = self._by_id.get(id(weights))
        if key is not None and self._given.get(key) is weights:
            return key
        kinds = {type(w) for w in self._given.values()}
        try:
            if weights in self._weights:
                return weights
        except TypeError:                      # unhashable: a weights object, not a key
            pass
        if type(weights) in kinds or not isinstance(weights, Hashable):
            raise KeyError(f"Engine.run: these {type(weights).__name__} were not given to the "
                           f"engine (weights must be bound before the workers fork)")
        raise KeyError(f"Engine.run: no weights under key {weights!r} (have "
                       f"{sorted(self._weights, key=repr)})")

    def bound(self, key: Hashable) -> Any:
        """The typed weights bound under ``key`` (what the tasks read)."""
        return self._weights[self.weights_key(key)]

    def _plan_index(self, plan: Plan) -> int:
        for i, p in enumerate(self._plans):
            if p is plan or p == plan:
                return i
        raise ValueError(f"Engine.run: the {plan.label} plan was not among this engine's needs "
                         f"({', '.join(p.label for p in self._plans)})")

    @serialized
    def run_plan(self, plan: Plan, weights: Any, T: int,
                 views: Mapping[str, np.ndarray | None], params: tuple = ()) -> dict[str, int]:
        """Every stage of ``plan`` in order, with ``weights`` (a key or a bound object), at
        ``T`` tokens, on ``views`` (io name -> a row range of an engine buffer, shaped as
        ``plan.io(T)`` says; None or absent for an optional one) and the plan's ``params`` (a
        small hashable tuple its context reads). Returns microseconds per timing key."""
        return self.execute(plan, T, self.prepare(plan, weights, T, views, params))

    def prepare(self, plan: Plan, weights: Any, T: int,
                views: Mapping[str, np.ndarray | None], params: tuple = ()) -> tuple:
        """The checks of :meth:`run_plan`, before any work: the wire of that run. (A family's
        own ``run`` calls this, writes its state buffers, then :meth:`execute`, all under the
        engine's lock.)"""
        if self.pool is None or self.arena is None or self.arena.closed:
            raise RuntimeError("Engine.run: the engine is closed")
        if plan.config != self.config:
            raise ValueError("Engine.run: the plan's config is not the engine's")
        index = self._plan_index(plan)
        key = self.weights_key(weights)
        spec = plan.io(T)
        unknown = [n for n, v in views.items() if n not in spec and v is not None]
        if unknown:
            raise ValueError(f"Engine.run: the {plan.label} plan takes no {sorted(unknown)}")
        refs = []
        for name, io in spec.items():
            v = views.get(name)
            if v is None:
                if not io.optional:
                    raise ValueError(f"Engine.run: the {plan.label} plan needs {name!r}")
                refs.append((name, None))
            else:
                refs.append((name, tuple(self.ref(name, v, io.shape, io.dtype))))
        for n, shape in plan.scratch(T).items():
            if math.prod(shape) > self._cap.get(n, 0):
                raise ValueError(f"Engine.run: {plan.label} at T={T} needs more scratch than "
                                 f"this engine was sized for (needs: "
                                 f"{[(p.label, t) for p, t in self.needs]})")
        return (index, key, int(T), tuple(params), tuple(refs))

    @serialized
    def execute(self, plan: Plan, T: int, wire: tuple) -> dict[str, int]:
        """Run the stages of a prepared ``wire`` (from :meth:`prepare`); microseconds per key."""
        if self.pool is None:
            raise RuntimeError("Engine.run: the engine is closed")
        now = time.perf_counter_ns
        spent = dict.fromkeys(plan.timing_keys, 0)
        index = wire[0]
        pool = self.pool
        splits = []
        t_start = now()
        stages = plan.stages
        k = 0
        while k < len(stages):
            s = stages[k]
            group = self._row_group(plan, T, wire, k)
            if len(group) > 1:
                self._run_group(group, T, wire, spent, splits)
                k += len(group)
                continue
            k += 1
            t0 = now()
            split = None
            if self.ranks is not None:
                key = (index, s.name, T)
                if key not in self._splits:          # a T below the needs': same rule
                    self._splits[key] = self._check_split(plan, s, T)
                split = self._splits[key]
            # a stage split across ranks keeps the extent its gathers are written for
            m = plan.extent(s, T, None if split is not None else wire[3])
            if split is None:
                used = pool.run(s.name, m, arg=wire)
                t1 = now()
            else:
                lo, hi = self.ranks.band(m)
                used = pool.run(s.name, hi, lo=lo, arg=wire)
                t1 = now()
                self._exchange(index, T, wire, s, m, split)
                self.exchange_us += (now() - t1) // 1000
            busy = pool.last_busy_ns if used else ()
            splits.append(StageSplit(s.name, t1 - t0, max(busy, default=0),
                                     min(busy, default=0), m))
            spent[s.timer] += now() - t0
        spent[TOTAL_KEY] = now() - t_start
        self.last_split = tuple(splits)
        return {k: ns // 1000 for k, ns in spent.items()}

    def _row_group(self, plan: Plan, T: int, wire: tuple, k: int) -> tuple[Stage, ...]:
        """The row group starting at stage ``k`` of a run (:data:`ROW_GROUPS`): the row-local
        stages from ``k`` on, or stage ``k`` alone."""
        stages, params = plan.stages, wire[3]

        def local(s: Stage) -> bool:
            return plan.row_local(s, params) and plan.extent(s, T, params) == T
        if not ROW_GROUPS or self.ranks is not None or not local(stages[k]):
            return stages[k:k + 1]
        j = k + 1
        while j < len(stages) and local(stages[j]):
            j += 1
        return stages[k:j]

    def _run_group(self, group: tuple[Stage, ...], T: int, wire: tuple,
                   spent: dict[str, int], splits: list[StageSplit]) -> None:
        """One dispatch of a row group over ``[0, T)``; each stage's share of its wall time
        into ``spent`` and ``splits`` (:class:`StageSplit`)."""
        now = time.perf_counter_ns
        pool = self.pool
        names = tuple(s.name for s in group)
        t0 = now()
        used = pool.run("+".join(names), T, task=GROUP_TASK, arg=(wire, names),
                        stages=len(names))       # each stage gets stage_timeout
        wall = now() - t0
        parts = [p for p in (pool.last_parts_ns if used else ()) if p is not None]
        per = [[p[i] for p in parts] for i in range(len(group))] if parts else \
            [[0] for _ in group]
        # the slowest band's whole group, shared out in proportion to each stage's slowest
        # band; what the wall adds to it (dispatch, wake-ups, collection) goes to the first
        # stage, so StageSplit.overhead still sums to the pool's cost
        slowest = max((sum(p) for p in parts), default=0)
        tops = [max(v) for v in per]
        top = sum(tops)
        shares = [slowest * t // top if top else 0 for t in tops]
        shares[0] += wall - sum(shares)                  # the pool's cost and the rounding
        for s, share, v in zip(group, shares, per):
            splits.append(StageSplit(s.name, share, max(v), min(v), T, group[0].name))
            spent[s.timer] += share

    def run_task(self, name: str, m: int, arg: Any = None) -> int:
        """Run extra task ``name`` (given as ``tasks=``) over ``[0, m)`` in the workers (bands
        ``[i*m//n, (i+1)*m//n)``); ``arg`` is a small picklable value. Returns microseconds."""
        if self.pool is None or self.arena is None or self.arena.closed:
            raise RuntimeError("Engine.run_task: the engine is closed")
        if name not in self._extra:
            raise KeyError(f"Engine.run_task: no extra task {name!r} (have "
                           f"{sorted(self._extra)})")
        t0 = time.perf_counter_ns()
        self.pool.run(name, int(m), arg=arg)
        return (time.perf_counter_ns() - t0) // 1000

    def _release_views(self) -> None:
        """Drop every view of the arena in place (tasks share these dicts), so unmapping the
        segment releases it now rather than at the next cyclic garbage collection."""
        for c in self._ctx.values():
            c.release()
        self._ctx.clear()
        self._views.clear()
        getattr(self, "_v", {}).clear()
        getattr(self, "_state", {}).clear()
        getattr(self, "_addr", {}).clear()

    def close(self) -> None:
        """Stop the workers, then unlink and unmap the arena. Idempotent; waits for a call
        running in another thread; safe on an engine whose ``__init__`` did not finish."""
        lock = self._lock
        if lock is None:                  # __init__ stopped before anything was acquired
            return
        with lock:
            try:
                if self.pool is not None:
                    self.pool.close()
            finally:
                self._release_views()
                if self.arena is not None:
                    self.arena.close()

    @property
    def closed(self) -> bool:
        return self.arena is None or self.arena.closed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        needs = ", ".join(f"{p.label}@{T}" for p, T in self.needs)
        mb = self.arena.nbytes / 1e6 if self.arena is not None else 0.0
        return f"<{type(self).__name__} {needs}; {len(self._weights)} blocks; arena {mb:.1f} MB>"


class EngineSession(Closing):
    """Base of a family's session: ``engine``, the one :class:`Engine` (arena + forked pool)
    reused by every call it was sized for. ``usable`` while the engine and its pool are open;
    ``close()`` (or ``with``) closes the engine."""

    engine: Engine

    @property
    def usable(self) -> bool:
        e = self.engine
        return not e.closed and e.pool is not None and not e.pool.closed

    def close(self) -> None:
        self.engine.close()
