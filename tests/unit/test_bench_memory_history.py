"""bench/memory_history.py: a free hole of the default pool is named by the last allocation that lay over it
(not an earlier one, not one beside it, not a graph pool's block), and whether a page of it was unmapped
after that allocation's free is told apart."""

from __future__ import annotations

from bench.memory_history import MB, attribute, free_holes, own_frames, summarize, table


def frames(*where: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


LOAD = frames(("/x/torch/nn/functional.py", 9, "pad"), ("/repo/qserve/model/loader.py", 120, "load_weights"),
              ("/repo/qserve/engine/engine.py", 40, "__init__"))  # fmt: skip
SHUFFLE = frames(
    ("/repo/quant_kernels/shuffle.py", 77, "mma_shuffle"), ("/repo/qserve/layers/linear.py", 300, "process")
)
WARMUP = frames(
    ("/repo/qserve/runner/warmup.py", 12, "profile_run"),
)


def snapshot() -> dict:
    base = 1 << 32
    return {
        "segments": [
            {  # the default pool: live 4 MB, hole 8 MB, live 2 MB, hole 6 MB, a small hole of 0.5 MB
                "address": base, "segment_pool_id": (0, 0), "stream": 0,
                "blocks": [
                    {"size": 4 * MB, "state": "active_allocated"},
                    {"size": 8 * MB, "state": "inactive"},
                    {"size": 2 * MB, "state": "active_allocated"},
                    {"size": 6 * MB, "state": "inactive"},
                    {"size": MB // 2, "state": "inactive"},
                ],
            },
            {  # a graph's private pool: its free block is not the default pool's
                "address": base + (1 << 30), "segment_pool_id": (1, 2), "stream": 0,
                "blocks": [{"size": 16 * MB, "state": "inactive", "address": base + (1 << 30)}],
            },
        ],
    }  # fmt: skip


def test_holes_are_the_default_pools_free_blocks() -> None:
    holes = free_holes(snapshot())
    base = 1 << 32
    assert [(h.address - base, h.size) for h in holes] == [(4 * MB, 8 * MB), (14 * MB, 6 * MB)]
    assert len(free_holes(snapshot(), min_bytes=MB // 4)) == 3


def test_the_last_occupant_names_a_hole() -> None:
    base = 1 << 32
    holes = free_holes(snapshot())
    trace = [
        {"action": "alloc", "addr": base + 4 * MB, "size": 8 * MB, "frames": LOAD},  # first occupant of hole 1
        {"action": "free_completed", "addr": base + 4 * MB, "size": 8 * MB},
        {"action": "alloc", "addr": base + 6 * MB, "size": 2 * MB, "frames": SHUFFLE},  # the last one over it
        {"action": "free_completed", "addr": base + 6 * MB, "size": 2 * MB},
        {"action": "alloc", "addr": base + 12 * MB, "size": 2 * MB, "frames": LOAD},  # beside the holes: live
        {"action": "alloc", "addr": base + 14 * MB, "size": 6 * MB, "frames": WARMUP},
        {"action": "free_completed", "addr": base + 14 * MB, "size": 6 * MB},
        {"action": "segment_unmap", "addr": base + 16 * MB, "size": 2 * MB},  # one page of hole 2 given back
    ]
    attribute(holes, trace)
    assert holes[0].last_alloc["frames"] is SHUFFLE and not holes[0].unmapped_after_free
    assert holes[1].last_alloc["frames"] is WARMUP and holes[1].unmapped_after_free
    rows = summarize(holes)
    assert rows[0][:4] == ("quant_kernels/shuffle.py:77 mma_shuffle < qserve/layers/linear.py:300 process", 1,
                           8 * MB, 8 * MB)  # fmt: skip
    assert rows[0][4] == 1 and rows[1][4] == 0  # still mapped / unmapped after the free
    assert "| `qserve/runner/warmup.py:12 profile_run` | 1 | 6.0 |" in table(rows)


def test_an_unmap_before_the_last_occupant_does_not_count() -> None:
    base = 1 << 32
    holes = free_holes(snapshot())
    trace = [
        {"action": "segment_unmap", "addr": base + 4 * MB, "size": 8 * MB},
        {"action": "alloc", "addr": base + 4 * MB, "size": 8 * MB, "frames": LOAD},
        {"action": "free_completed", "addr": base + 4 * MB, "size": 8 * MB},
    ]
    attribute(holes, trace)
    assert holes[0].last_alloc["frames"] is LOAD and not holes[0].unmapped_after_free
    assert holes[1].last_alloc is None
    assert summarize(holes)[1][0] == "(no alloc over it in the recorded history)"


def test_own_frames_skips_torch_and_keeps_the_innermost() -> None:
    assert own_frames(LOAD, depth=1) == "qserve/model/loader.py:120 load_weights"
    assert (
        own_frames(
            frames(
                ("/x/torch/a.py", 1, "f"),
            )
        )
        == "(no qserve frame)"
    )
