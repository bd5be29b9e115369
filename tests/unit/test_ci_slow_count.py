"""tests/conftest.py's collection hook: the slow-test count for .ci/run's lowest job (CPU tests marked
slow, counted before ``-m`` deselects them, written only when ``QSERVE_CI_SLOW_COUNT`` names a file),
the launch-compile tests moved to the end of the session, and the ``interpreted`` marker the lowest job
deselects."""

from __future__ import annotations

from pathlib import Path

from tests import conftest


class _Item:
    def __init__(self, *marks: str, path: str = "tests/unit/test_x.py") -> None:
        self.marks = set(marks)
        self.path = Path(path)

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.marks else None

    def add_marker(self, marker) -> None:
        self.marks.add(marker.name)


def test_counts_the_slow_cpu_tests_only_when_asked(tmp_path, monkeypatch):
    items = [_Item("slow"), _Item("slow", "gpu"), _Item(), _Item("slow", "peer"), _Item("slow")]
    target = tmp_path / "slow-count"
    monkeypatch.delenv("QSERVE_CI_SLOW_COUNT", raising=False)
    conftest.pytest_collection_modifyitems(None, items)
    assert not target.exists()
    monkeypatch.setenv("QSERVE_CI_SLOW_COUNT", str(target))
    conftest.pytest_collection_modifyitems(None, items)
    assert target.read_text() == "2"  # the GPU and peer tests run in neither CPU job


def test_the_launch_compile_tests_run_last_in_their_order(monkeypatch):
    """Their compiles start at the end of collection and run beside the other tests: the later these
    tests come, the less they wait."""
    monkeypatch.delenv("QSERVE_CI_SLOW_COUNT", raising=False)
    compile_a = _Item(path="tests/kernels/test_launch_compile.py")
    compile_b = _Item("slow", path="tests/kernels/test_launch_compile.py")
    others = [_Item(path="tests/browser/test_a.py"), _Item(path="tests/kernels/test_b.py"), _Item()]
    items = [others[0], compile_a, others[1], compile_b, others[2]]
    conftest.pytest_collection_modifyitems(None, items)
    assert items == [*others, compile_a, compile_b]


def test_interpreted_marks_the_cpu_tests_of_the_interpreted_kernel_modules(monkeypatch):
    """The lowest CI job runs ``-m "... and not interpreted"``: the interpreted modules' CPU tests get the
    marker, their GPU tests and every other module's tests (the PTX / SASS and launch-compile ones) do not."""
    monkeypatch.delenv("QSERVE_CI_SLOW_COUNT", raising=False)
    numerics, on_gpu = _Item(path="tests/kernels/test_moe_mma.py"), _Item("gpu", path="tests/kernels/test_moe_mma.py")
    ptx, launches = _Item(path="tests/kernels/test_w4a16_ptx.py"), _Item(path="tests/kernels/test_launch_compile.py")
    same_name_elsewhere = _Item(path="tests/integration/test_lora.py")  # "test_lora.py" is also a kernel module
    conftest.pytest_collection_modifyitems(None, [numerics, on_gpu, ptx, launches, same_name_elsewhere])
    assert numerics.get_closest_marker("interpreted")
    assert not any(i.get_closest_marker("interpreted") for i in (on_gpu, ptx, launches, same_name_elsewhere))


def test_every_interpreted_module_exists():
    """A renamed module would leave the marker naming nothing (collection refuses that too)."""
    kernels = Path(conftest.__file__).parent / "kernels"
    assert conftest.INTERPRETED_MODULES and all((kernels / name).is_file() for name in conftest.INTERPRETED_MODULES)
