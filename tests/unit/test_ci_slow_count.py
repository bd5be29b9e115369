"""tests/conftest.py's slow-test count for .ci/run's lowest job: CPU tests marked slow, counted before
``-m`` deselects them, written only when ``QSERVE_CI_SLOW_COUNT`` names a file."""

from __future__ import annotations

from tests import conftest


class _Item:
    def __init__(self, *marks: str) -> None:
        self.marks = set(marks)

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.marks else None


def test_counts_the_slow_cpu_tests_only_when_asked(tmp_path, monkeypatch):
    items = [_Item("slow"), _Item("slow", "gpu"), _Item(), _Item("slow", "peer"), _Item("slow")]
    target = tmp_path / "slow-count"
    monkeypatch.delenv("QSERVE_CI_SLOW_COUNT", raising=False)
    conftest.pytest_collection_modifyitems(None, items)
    assert not target.exists()
    monkeypatch.setenv("QSERVE_CI_SLOW_COUNT", str(target))
    conftest.pytest_collection_modifyitems(None, items)
    assert target.read_text() == "2"  # the GPU and peer tests run in neither CPU job
