"""Capture every Triton launch qserve makes and compile it for a GPU this machine does not have.

Knows: Triton's launch entry point (``JITFunction.run``) and its active driver, torch's dispatcher
(to stand in for the heavy torch ops between launches), and ``quant_kernels.device`` (the one place
the wrappers ask about the device). Must not know: which kernels exist or what they compute.

Inside ``simulated_gpu(gpu)``:

- ``quant_kernels.device`` answers for CPU tensors as a GPU of ``gpu.arch`` with ``gpu.sms`` SMs and
  ``gpu.max_shared`` bytes of shared memory a block:
  the engine's CPU tensors take the CUDA branches, so the real dispatch and the real wrappers build
  the real arguments;
- Triton's active driver reports that GPU's target, and each launch (``kernel[grid](...)``) goes
  through Triton's own ``JITFunction.run`` with ``warmup=True``: the same binding, specialization
  (argument dtypes, 16-byte alignment, integers equal to 1), options and ahead-of-time compile
  (``triton.compile`` down to the cubin with that target's ``ptxas``) as a real launch, stopping
  short of the launch itself;
- each launch is then checked against what that GPU would refuse at launch time: shared memory
  per block and grid limits;
- no kernel runs, so matrix products return zeros without computing them (their operands hold
  whatever the allocator left; the logits are such a product, so the sampler sees finite values).

A failed compile is recorded, not raised, so one run lists every broken launch.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class SimulatedGpu:
    """What a launch on this GPU depends on: the compile target and the launch-time limits."""

    name: str
    arch: int  # compute capability as 10 * major + minor (90: H100 / H200)
    sms: int
    max_shared: int  # bytes of shared memory one block may opt into


# The cards qserve is for, and the one it is measured on. Shared memory: the opt-in maximum per
# block (CUDA programming guide, "Compute capabilities" table).
GPUS = {
    "sm90": SimulatedGpu("H100 / H200 (sm90)", 90, 132, 232448),
    "sm89": SimulatedGpu("RTX 4090 / L4 (sm89)", 89, 128, 101376),
    "sm86": SimulatedGpu("RTX 3090 / A10G (sm86)", 86, 82, 101376),
}
MAX_GRID_YZ = 65535
MAX_GRID_X = 2**31 - 1


@dataclass
class Launch:
    """One distinct launch: a kernel with one set of argument types, constexprs and options."""

    kernel: str
    signature: tuple[str, ...]  # one entry per positional argument: "*fp16", "i32=1", "i32%16", "fp32", ...
    constexprs: tuple[tuple[str, object], ...]  # keyword arguments (constexprs and launch options)
    site: str  # the wrapper line that launched it
    where: str  # what the driver was doing (model, dtype, step)
    grid: tuple[int, ...]
    count: int = 1
    error: str | None = None  # compile failure or a launch-time limit it would break
    shared: int | None = None  # bytes of shared memory the compiled kernel needs
    compile_seconds: float = 0.0

    def describe(self) -> str:
        kwargs = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.kernel}({', '.join(self.signature)}; {kwargs}) at {self.site} [{self.where}]"


@dataclass
class Capture:
    """What ``simulated_gpu`` collected: distinct launches in the order first seen."""

    gpu: SimulatedGpu
    launches: dict[tuple, Launch] = field(default_factory=dict)
    where: str = ""
    compile_seconds: float = 0.0  # inside Triton's compile (the rest is the engine's own Python)

    @property
    def failures(self) -> list[Launch]:
        return [launch for launch in self.launches.values() if launch.error]

    def kernels(self) -> set[str]:
        return {launch.kernel for launch in self.launches.values()}


def _describe_arg(value: object) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"*{dtype}" + ("" if value.data_ptr() % 16 == 0 else " (unaligned)")
    if isinstance(value, bool):
        return f"bool={value}"
    if isinstance(value, int):
        width = "i64" if not -(2**31) <= value < 2**31 else "i32"
        if value == 1:
            return f"{width}=1"
        return f"{width}%16" if value % 16 == 0 else width
    if isinstance(value, float):
        return "float"
    if value is None:
        return "None"
    return type(value).__name__


def _launch_site() -> str:
    """The first frame outside Triton and this module: the wrapper line that launched the kernel."""
    frame = sys._getframe(2)
    here = Path(__file__).resolve()
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if "triton" not in path.parts and path.resolve() != here:
            try:
                shown = path.resolve().relative_to(Path.cwd())
            except ValueError:
                shown = path.name
            return f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def _root_cause(exc: BaseException) -> str:
    """The innermost message of a (chained) compile error, on one line, plus the outer type."""
    inner = exc
    while inner.__cause__ is not None:
        inner = inner.__cause__
    message = str(inner).strip().splitlines()[-1] if str(inner).strip() else type(inner).__name__
    return f"{type(exc).__name__}: {message}"


class _FakeDriver:
    """Triton's active driver as a GPU of one architecture: its target, device and stream ids."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.device = 1000 + arch  # a device id of its own: Triton keeps one kernel cache per device

    def get_current_target(self):  # noqa: ANN201 - a GPUTarget
        return self.target

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True


class _NoProducts(TorchDispatchMode):
    """Matrix products return zeros without computing: no kernel wrote their operands, and the
    dequantize + cuBLAS path at thousands of rows would take minutes on a CPU. (The logits come
    from such a product, so the sampler downstream sees finite values.)"""

    PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
    PRODUCTS_OUT = {torch.ops.aten.mm.out, torch.ops.aten.addmm.out}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in self.PRODUCTS_OUT:
            return kwargs["out"]
        if func in self.PRODUCTS:
            a, b = args[-2], args[-1]
            return torch.zeros((*a.shape[:-1], b.shape[-1]), dtype=a.dtype, device=a.device)
        return func(*args, **kwargs)


def _outside_grid_limits(dims: tuple[int, ...]) -> bool:
    return any(d < 0 for d in dims) or (bool(dims) and dims[0] > MAX_GRID_X) or any(d > MAX_GRID_YZ for d in dims[1:])


_lock = threading.Lock()


@contextlib.contextmanager
def simulated_gpu(gpu: SimulatedGpu, compile: bool = True) -> Iterator[Capture]:
    """Run qserve's CPU tensors through its CUDA launch paths as on ``gpu``; yields the ``Capture``.
    ``compile=False`` records each launch (arguments, constexprs, grid) without compiling it: for
    checks of what the launches look like where another drive compiles the same launches.

    One at a time per process (Triton's driver and ``JITFunction.run`` are process-wide).
    """
    from triton.runtime import jit as triton_jit
    from triton.runtime.driver import driver

    from quant_kernels import device as kdevice

    capture = Capture(gpu)
    original_run = triton_jit.JITFunction.run

    def run(fn, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202 - Triton's own signature
        signature = tuple(_describe_arg(a) for a in args)
        options = tuple(
            sorted((k, v if isinstance(v, int | float | str | bool) else repr(v)) for k, v in kwargs.items())
        )
        name = getattr(fn, "__name__", None) or fn.fn.__name__
        key = (name, signature, options)
        dims = tuple(grid(dict(zip(fn.arg_names, args))) if callable(grid) else grid)
        launch = capture.launches.get(key)
        if launch is not None:  # compiled already; the grid is this launch's own
            launch.count += 1
            if _outside_grid_limits(dims) and not launch.error:
                launch.error, launch.grid, launch.where = f"grid {dims} is outside CUDA's limits", dims, capture.where
            return None
        launch = Launch(name, signature, options, _launch_site(), capture.where, dims)
        capture.launches[key] = launch
        if not compile:
            if _outside_grid_limits(dims):
                launch.error = f"grid {dims} is outside CUDA's limits"
            return None
        start = time.perf_counter()
        try:
            compiled = original_run(fn, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and reported together
            launch.error = _root_cause(exc)
            return None
        finally:
            launch.compile_seconds = time.perf_counter() - start
            capture.compile_seconds += launch.compile_seconds
        launch.shared = int(compiled.metadata.shared)
        problems = []
        if launch.shared > gpu.max_shared:
            problems.append(f"needs {launch.shared} B of shared memory, {gpu.name} allows {gpu.max_shared}")
        if _outside_grid_limits(dims):
            problems.append(f"grid {dims} is outside CUDA's limits")
        if problems:
            launch.error = "; ".join(problems)
        return None

    with _lock, contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(triton_jit.JITFunction, "run", run))
        stack.enter_context(mock.patch.object(kdevice, "triton_serves", lambda device: True))
        stack.enter_context(mock.patch.object(kdevice, "capability", lambda device: divmod(gpu.arch, 10)))
        stack.enter_context(mock.patch.object(kdevice, "sm_count", lambda device, default: gpu.sms))
        stack.enter_context(mock.patch.object(kdevice, "max_shared", lambda device: gpu.max_shared))
        previous = driver._active  # None on a machine without a GPU (reset_active would fail there)
        driver.set_active(_FakeDriver(gpu.arch))
        stack.callback(setattr, driver, "_active", previous)
        stack.enter_context(_NoProducts())
        yield capture


@contextlib.contextmanager
def where(capture: Capture, label: str) -> Iterator[None]:
    """Label the launches made inside the block (shown with any failure)."""
    before, capture.where = capture.where, label
    try:
        yield
    finally:
        capture.where = before
