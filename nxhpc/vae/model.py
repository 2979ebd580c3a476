"""The FLUX autoencoder's decoder on nxhpc's kernels: latents [16, h, w] -> pixels [3, 8h, 8w].

Owns :class:`VaeDecoder` (open a file, bind its weights zero copy, ``decode``), the forward in
the order the network reads (:func:`forward`), the step program it records (each step one
banded kernel call over named buffers) and its run: in this process (``workers=1``, numpy
buffers), or on one arena and one forked pool (sized for the largest latent seen; a bigger one
rebuilds both) -- the shared :class:`~nxhpc.nn.engine.Engine`, each step one run of its extra
task ``vae_step``. Every step is a kernel over a band whose bits do not depend on the band, so the
output is bit-identical for every worker count. Activations are channels-last rows [H*W, C].
Must not: import the registry, torch or diffusers; make a whole im2col or score matrix.

    h = conv_in(z / scaling + shift)                                3x3, 16 -> 512
    h = mid.resnets[0](h); h = mid.attentions[0](h); h = mid.resnets[1](h)
    for level in up_blocks (512, 512, 256, 128): 3 x resnet; nearest x2 + 3x3 conv (not last)
    x = conv_out(silu(conv_norm_out(h)))                            3x3, 128 -> 3
"""
from __future__ import annotations

import math
import os
import threading
from typing import Any

import numpy as np

import nxhpc
from nxhpc.formats.closing import Closing
from nxhpc.nn.engine import Engine, Plan
from nxhpc.nn.conv import CONV_PRECISIONS, conv1x1_band, conv3x3_band
from nxhpc.nn.linear import attention_precision
from nxhpc.runtime import proc
from nxhpc.runtime.checks import (CheckError, check_choice, check_finite_output,
                                  check_count, check_float_array, check_workers)
from nxhpc.runtime.shm import arena_bytes, check_room
from nxhpc.runtime.workers import check_timeout
from nxhpc.vae.config import VaeConfig
from nxhpc.vae.files import Conv, Norm, VaeFile, bind, open_vae_file

__all__ = ["OUTPUT_BYTES_PER_VALUE", "VaeDecoder", "forward", "Program", "Step"]

Step = tuple[str, int, tuple]        # (kind, extent m, params): bands split [0, m)


class Program:
    """The decoder's steps for one latent size, recorded in the order :func:`forward` issues
    them, with the size every buffer needs (floats). Buffers: ``z`` (the scaled latents as rows),
    ``a`` (the running activation), ``t`` and ``b`` (scratch), ``q``, ``k``, ``qkv`` (the mid
    attention), ``part`` (GroupNorm partials, float64), ``img`` (the output rows)."""

    def __init__(self, config: VaeConfig, chunk: int) -> None:
        self.config = config
        self.chunk = chunk
        self.steps: list[Step] = []
        self.sizes: dict[str, int] = {}
        self.cur, self.tmp = "a", "t"       # the running activation and its scratch twin

    def need(self, buf: str, n: int) -> None:
        self.sizes[buf] = max(self.sizes.get(buf, 0), int(n))

    def add(self, kind: str, m: int, *params: Any) -> None:
        self.steps.append((kind, int(m), tuple(params)))

    # -- layers, each a few banded steps
    def group_norm(self, mod: str, src: str, dst: str, P: int, C: int, silu: bool) -> None:
        nk = -(-P // self.chunk)
        self.need("part", nk * self.config.norm_num_groups * 2)
        self.need(dst, P * C)
        self.add("gn_partials", nk, mod, src, P, C)
        self.add("gn_apply", P, mod, src, dst, P, C, silu)

    def conv3x3(self, mod: str, src: str, dst: str, H: int, W: int, cin: int, cout: int,
                upsample: bool = False) -> None:
        Ho, Wo = (2 * H, 2 * W) if upsample else (H, W)
        self.need(dst, Ho * Wo * cout)
        self.add("conv3x3", Ho * Wo, mod, src, dst, H, W, cin, cout, upsample)

    def conv1x1(self, mod: str, src: str, dst: str, P: int, cin: int, cout: int) -> None:
        self.need(dst, P * cout)
        self.add("conv1x1", P, mod, src, dst, P, cin, cout)

    def add_into(self, dst: str, a: str, b: str, n: int) -> None:
        """dst := a + b over n floats."""
        self.need(dst, n)
        self.add("add", n, dst, a, b)

    def resnet(self, mod: str, H: int, W: int, cin: int, cout: int) -> None:
        """x := shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x)))))), x the running
        activation (shortcut: identity, or a 1x1 conv where the width changes)."""
        P, x, t = H * W, self.cur, self.tmp
        self.group_norm(f"{mod}.norm1", x, t, P, cin, True)
        self.conv3x3(f"{mod}.conv1", t, "b", H, W, cin, cout)
        self.group_norm(f"{mod}.norm2", "b", "b", P, cout, True)
        self.conv3x3(f"{mod}.conv2", "b", t, H, W, cout, cout)
        if cin != cout:
            self.conv1x1(f"{mod}.conv_shortcut", x, "b", P, cin, cout)
            self.add_into(x, "b", t, P * cout)
        else:
            self.add_into(x, x, t, P * cout)

    def upsample_conv(self, mod: str, H: int, W: int, C: int) -> None:
        """x := conv3x3(nearest x2(x)) (the upsampling read through the im2col rows: no
        upsampled copy), into the scratch twin, which then becomes the running activation."""
        self.conv3x3(mod, self.cur, self.tmp, H, W, C, C, upsample=True)
        self.cur, self.tmp = self.tmp, self.cur

    def attention(self, mod: str, H: int, W: int, C: int) -> None:
        """a := a + to_out(softmax(q k^T / sqrt(C)) v), q, k, v = linears of group_norm(a)."""
        P, x, t = H * W, self.cur, self.tmp
        self.group_norm(f"{mod}.group_norm", x, t, P, C, False)
        self.need("qkv", P * 3 * C)
        self.conv1x1(f"{mod}.to_q", t, "q", P, C, C)
        self.conv1x1(f"{mod}.to_k", t, "k", P, C, C)
        self.conv1x1(f"{mod}.to_v", t, "b", P, C, C)
        self.add("v_into_qkv", P, "b", P, C)
        self.add("attention", P, t, P, C)                 # t := attention (query rows)
        self.conv1x1(f"{mod}.to_out.0", t, "b", P, C, C)
        self.add_into(x, x, "b", P * C)


def forward(prog: Program, h: int, w: int) -> None:
    """Record the decoder on latents of h x w into ``prog`` (the layer order of the network)."""
    cfg = prog.config
    top = cfg.up_channels[0]
    prog.need("z", h * w * cfg.latent_channels)
    prog.conv3x3("decoder.conv_in", "z", prog.cur, h, w, cfg.latent_channels, top)
    H, W = h, w
    prog.resnet("decoder.mid_block.resnets.0", H, W, top, top)
    if cfg.mid_attention:
        prog.attention("decoder.mid_block.attentions.0", H, W, top)
    prog.resnet("decoder.mid_block.resnets.1", H, W, top, top)
    for i, cout in enumerate(cfg.up_channels):
        cin = cfg.level_in_channels(i)
        for j in range(cfg.layers_per_block + 1):
            prog.resnet(f"decoder.up_blocks.{i}.resnets.{j}", H, W, cin if j == 0 else cout, cout)
        if i < cfg.levels - 1:
            prog.upsample_conv(f"decoder.up_blocks.{i}.upsamplers.0.conv", H, W, cout)
            H, W = 2 * H, 2 * W
    last = cfg.up_channels[-1]
    prog.group_norm("decoder.conv_norm_out", prog.cur, prog.tmp, H * W, last, True)
    prog.conv3x3("decoder.conv_out", prog.tmp, "img", H, W, last, cfg.out_channels)


class _Executor:
    """Runs one step's band in whichever process holds it: buffers by name (numpy arrays or the
    arena's views), modules by name, the kernels."""

    def __init__(self, mods: dict[str, Conv | Norm], precision: str, groups: int, eps: float,
                 chunk: int) -> None:
        self.kern = nxhpc.kernels()
        self.mods = mods
        self.precision = precision
        self.groups = groups
        self.eps = eps
        self.chunk = chunk
        self.bufs: dict[str, np.ndarray] = {}

    def view(self, name: str, *shape: int) -> np.ndarray:
        return self.bufs[name][:math.prod(shape)].reshape(shape)

    def run(self, kind: str, lo: int, hi: int, p: tuple) -> None:
        K, v = self.kern, self.view
        if kind == "conv3x3":
            mod, src, dst, H, W, cin, cout, up = p
            c = self.mods[mod]
            n = (4 if up else 1) * H * W
            conv3x3_band(K, v(src, H * W, cin), H, W, c.w, c.b, v(dst, n, cout), lo, hi,
                         upsample=up, precision=self.precision)
        elif kind == "conv1x1":
            mod, src, dst, P, cin, cout = p
            c = self.mods[mod]
            conv1x1_band(K, v(src, P, cin), c.w, c.b, v(dst, P, cout), lo, hi, self.precision)
        elif kind == "gn_partials":
            mod, src, P, C = p
            nk = -(-P // self.chunk)
            K.group_norm_partials(v(src, P, C), self.groups, self._part(nk), lo, hi,
                                  chunk=self.chunk)
        elif kind == "gn_apply":
            mod, src, dst, P, C, silu = p
            nrm = self.mods[mod]
            nk = -(-P // self.chunk)
            scale = np.empty(C, np.float32)
            shift = np.empty(C, np.float32)
            # every process merges the same partials in the same order: the same coefficients
            K.group_norm_coeffs(self._part(nk), P, nrm.gamma, nrm.beta, self.eps, scale, shift,
                                chunk=self.chunk)
            K.affine_act(v(src, P, C), scale, shift, v(dst, P, C), lo, hi, silu=silu)
        elif kind == "add":
            dst, a, b = p
            K.add(self.bufs[a][lo:hi], self.bufs[b][lo:hi], self.bufs[dst][lo:hi])
        elif kind == "v_into_qkv":
            src, P, C = p
            v("qkv", P, 3 * C)[lo:hi, 2 * C:] = v(src, P, C)[lo:hi]
        elif kind == "attention":
            dst, P, C = p
            # a band of query rows of the one head: every row's bits are the whole call's
            K.attention(v("q", 1, P, C), v("k", 1, P, C), v("qkv", P, 3 * C), v(dst, P, C),
                        1, 1.0 / math.sqrt(C), t0=lo, t1=hi,
                        precision=attention_precision(self.precision))
        else:                                                      # pragma: no cover
            raise ValueError(f"VaeDecoder: unknown step {kind!r}")

    def _part(self, nk: int) -> np.ndarray:
        return self.bufs["part"][:nk * self.groups * 2].reshape(nk, self.groups, 2)


class _StepPlan(Plan):
    """The decoder as the shared engine sees it: no stage table (every step runs as the extra
    task ``vae_step`` over the caller's named buffers), the convolution weights checked
    runnable once, in the parent, before the fork."""
    stages = ()

    def __init__(self, config: VaeConfig) -> None:
        self.config = config

    def extent(self, stage: Any, T: int,
               params: tuple | None = None) -> int:      # pragma: no cover - no stages
        raise NotImplementedError

    def scratch(self, T: int) -> dict[str, tuple[int, ...]]:
        return {}

    def io(self, T: int) -> dict:
        return {}

    def bind(self, key: Any, weights: Any, kernels: Any) -> Any:
        return weights

    def matrices(self, weights: Any) -> dict[str, Any]:
        return {n: m.w for n, m in weights.items() if isinstance(m, Conv)}


#: The GroupNorm statistics chunk of the decoder (rows); fixed, so never a function of workers.
GN_CHUNK = 128

#: Bytes of this process's memory per value of the output ``[C, H, W]`` beside the decode's
#: buffers: :meth:`VaeDecoder.decode`'s copy out of them and its finite check, then
#: :func:`~nxhpc.vae.image.to_uint8`'s temporaries and :func:`~nxhpc.vae.image.write_png`'s
#: bytes. tracemalloc's peak over those four, the buffers already made, is 16.0 bytes a value
#: (tiny-vae at 512x512, one and two workers); 20 leaves room for Pillow's and zlib's own
#: buffers, which it does not see. :meth:`VaeDecoder.check_room` adds 1 MiB.
OUTPUT_BYTES_PER_VALUE = 20


def _spec(sizes: dict[str, int]) -> dict[str, tuple[tuple[int], Any]]:
    """The buffers of a program's sizes (floats) as ``SharedArena`` specs: float32, the
    GroupNorm partials float64."""
    return {n: ((max(k, 1),), np.float64 if n == "part" else np.float32)
            for n, k in sizes.items()}


class VaeDecoder(Closing):
    """The FLUX autoencoder's decoder from ``path`` (a BFL/ComfyUI ``ae.safetensors`` or a
    diffusers VAE directory), weights zero copy from the map (float32/float16/bfloat16).

    ``workers``: processes (None = the usable CPUs; 1 = this process only). ``precision``:
    ``"f32"`` (the matmul on exact weights) or ``"bf16"`` (activations and weights rounded to
    bfloat16 in every convolution). ``stage_timeout``: seconds one parallel step may take
    before the workers are killed and the decode fails (a hung worker; None: no limit).
    ``decode(latents)`` takes the sampler's latents ``[16, h, w]`` (scaling and shift applied
    inside) and returns float32 ``[3, 8h, 8w]``, the decoder's output before clamping (about
    [-1, 1]). A context manager; ``close()`` releases the workers and the shared memory.
    """

    def __init__(self, path: str | os.PathLike, *, workers: int | None = None,
                 precision: str = "f32", stage_timeout: float | None = None) -> None:
        precision = check_choice(precision, CONV_PRECISIONS, "precision")
        self.workers = check_workers(workers)
        self.stage_timeout = check_timeout(stage_timeout)
        self._owner = os.getpid()
        self._lock = threading.RLock()     # one decode at a time: the buffers are shared
        self._engine: Engine | None = None
        self._capacity: dict[str, int] = {}
        self.file: VaeFile = open_vae_file(path)
        try:
            self.config = self.file.config
            self.mods = bind(self.file)
            kern = nxhpc.kernels()
            for m in self.mods.values():
                if isinstance(m, Conv) and m.w.type_name not in kern.weight_types():
                    raise NotImplementedError(f"{m.name}: {m.w.type_name} weights")
            self._exec = _Executor(self.mods, precision, self.config.norm_num_groups,
                                   self.config.eps, GN_CHUNK)
        except BaseException:
            self.file.close()
            raise
        self.last_timings: dict[str, float] = {}

    @property
    def precision(self) -> str:
        """The convolutions' precision (``f32`` or ``bf16``; the executor's, which the workers
        fork with); settable between calls."""
        return self._exec.precision

    @precision.setter
    def precision(self, value: str) -> None:
        p = check_choice(value, CONV_PRECISIONS, "VaeDecoder.precision")
        proc.check_owner(self._owner, "VaeDecoder.precision", "VaeDecoder")
        with self._lock:          # the workers read it from the executor forked with them
            if p != self._exec.precision:
                self._release()
                self._exec.precision = p

    # -- running
    def check_room(self, h: int, w: int, *, copies: int = 1) -> int:
        """The bytes of the buffers a decode of latents ``[C, h, w]`` needs (with workers: one
        shared-memory arena; with one: this process's memory). Raises
        :class:`~nxhpc.runtime.shm.ShmSpaceError` now if ``/dev/shm`` or the memory left could
        not hold them -- for a caller that decodes only after a long run (``generate`` checks
        before the sampling steps, whose denoiser is released before the decode). ``copies``:
        decoders on this host that will decode at the same time (MPI ranks, each with its
        own buffers). Nothing is reserved; buffers already held that are large enough need
        nothing more (0). Beside them, this process's own copies of the output
        (:data:`OUTPUT_BYTES_PER_VALUE`) are checked against the memory and the address space
        left, with the buffers: an address-space limit (ulimit -v) that held the buffers but
        not the picture made of them failed after the long run."""
        h, w = check_count(h, "h"), check_count(w, "w")
        copies = check_count(copies, "copies")
        prog = Program(self.config, GN_CHUNK)
        forward(prog, h, w)
        need = 0 if self._holds(prog.sizes) else arena_bytes(_spec(prog.sizes))
        s = self.config.upscale
        what = f"the autoencoder's decode at {h * s}x{w * s}"
        at_once = f" ({copies} at once on this host)" if copies > 1 else ""
        if need:
            check_room(need, what + at_once, shared=self.workers > 1, copies=copies)
        out = OUTPUT_BYTES_PER_VALUE * self.config.out_channels * h * s * w * s + (1 << 20)
        check_room(need + out, f"{what} with its output picture{at_once}", shared=False,
                   copies=copies)
        return need * copies

    def _holds(self, sizes: dict[str, int]) -> bool:
        """Whether the buffers held are at least ``sizes`` (floats per buffer)."""
        return bool(self._capacity) and all(self._capacity.get(n, -1) >= s
                                            for n, s in sizes.items())

    def _buffers(self, prog: Program) -> None:
        """Make the buffers of ``prog`` (and, with workers, the arena and the pool) if the ones
        held are too small."""
        sizes = dict(prog.sizes)
        eng = self._engine
        broken = eng is not None and (eng.closed or eng.pool is None or eng.pool.closed)
        if not broken and self._holds(sizes):
            return                 # a pool an interrupt or a dead worker closed is rebuilt
        self._release()
        spec = _spec(sizes)
        if self.workers == 1:
            self._exec.bufs = {n: np.empty(shape, dtype=dt) for n, (shape, dt) in spec.items()}
        else:
            ex = self._exec

            def step(eng: Engine, lo: int, hi: int, arg: tuple) -> None:
                """One program step's band, in whichever process runs it (views by name)."""
                if not ex.bufs:
                    ex.bufs = {n: eng.buffer(n) for n in spec}
                ex.run(arg[0], lo, hi, arg[1])
            self._engine = Engine([(_StepPlan(self.config), 1)], {"vae": self.mods},
                                  buffers=spec, workers=self.workers,
                                  stage_timeout=self.stage_timeout, tasks={"vae_step": step})
            self._exec.bufs = {n: self._engine.buffer(n) for n in spec}
        self._capacity = sizes

    def _run(self, prog: Program) -> None:
        for kind, m, params in prog.steps:
            if self._engine is None:
                self._exec.run(kind, 0, m, params)
            else:
                self._engine.run_task("vae_step", m, (kind, params))

    def decode(self, latents: Any) -> np.ndarray:
        """Pixels float32 [out_channels, 8h, 8w] (before clamping) of latents [C_z, h, w] in the
        sampler's space (the decoder reads ``latents / scaling + shift``). Thread-safe: calls
        from several threads are serialized. NonFiniteOutputError (``count``, ``size``,
        ``output``) when finite latents give NaN/inf pixels (an overflow inside the decoder,
        e.g. latents near float32's largest), never the NaN image itself."""
        proc.check_owner(self._owner, "VaeDecoder.decode", "VaeDecoder")
        with self._lock:
            return self._decode(latents)

    def _decode(self, latents: Any) -> np.ndarray:
        cfg = self.config
        if self.file is None:
            raise RuntimeError("VaeDecoder.decode: the decoder is closed")
        z = check_float_array(latents, "latents", ndim=3)
        if z.shape[0] != cfg.latent_channels:
            raise CheckError(f"latents: shape {list(z.shape)}, expected [{cfg.latent_channels}, "
                             f"h, w] (this decoder reads {cfg.latent_channels} channels)")
        c, h, w = z.shape
        if h < 1 or w < 1:
            raise CheckError(f"latents: shape {list(z.shape)}, expected positive sizes")
        prog = Program(cfg, GN_CHUNK)
        forward(prog, h, w)
        self._buffers(prog)
        rows = self._exec.view("z", h * w, c)
        with np.errstate(over="ignore"):   # huge finite latents: inf here, reported after
            zz = (z / np.float32(cfg.scaling_factor) + np.float32(cfg.shift_factor))
        rows[...] = zz.reshape(c, h * w).T
        self._run(prog)
        s = cfg.upscale
        img = self._exec.view("img", h * s * w * s, cfg.out_channels)
        # a copy always: with one channel img.T is already C-contiguous, and ascontiguousarray
        # returned a view of the arena (overwritten by the next call, kept mapped after close)
        out = np.array(img.T, order="C", copy=True).reshape(cfg.out_channels, h * s, w * s)
        return check_finite_output(out, "VaeDecoder.decode", f"finite latents overflowed "
                                   f"float32 inside the decoder; max |latent| "
                                   f"{float(np.max(np.abs(z))):.3g}", noun="pixel values")

    # -- lifetime
    def _release(self) -> None:
        self._exec.bufs = {}
        if self._engine is not None:
            eng, self._engine = self._engine, None
            eng.close()
        self._capacity = {}

    def close(self) -> None:
        """Stop the workers, release the shared memory, drop the file map (the weight views
        of it too, so the file is unmapped here, not when the object is collected).
        Idempotent; waits for a decode running in another thread. In a forked child: nothing
        (the parent's to close)."""
        if os.getpid() != getattr(self, "_owner", os.getpid()):
            return
        with self._lock:
            if getattr(self, "_exec", None) is not None:
                self._release()
                self._exec.mods = {}
            self.mods = {}
            if self.file is not None:
                self.file.close()
                self.file = None

    def __repr__(self) -> str:
        c = self.config
        return (f"<VaeDecoder {c.block_out_channels} z={c.latent_channels} "
                f"{self.file.layout if self.file else 'closed'} {self.precision} "
                f"workers={self.workers}>")

