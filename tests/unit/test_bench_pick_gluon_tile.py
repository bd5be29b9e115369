"""bench/pick_gluon_tile.py: the tile a layer-bench log timed fastest, over the layers and row counts asked,
each (layer, M) at the tile's best split; tiles missing a (layer, M) left out."""

from __future__ import annotations

from bench.pick_gluon_tile import scores

LOG = """\
qkv M=128 gluon m128 n64 k128 st3 w4 s1 a2: 30.0 us err 2.1e-04
qkv M=128 gluon m128 n64 k128 st3 w4 s2 a2: 24.0 us err 2.1e-04
qkv M=128 gluon m64 n128 k64 st4 w4 s1 a2: 20.0 us err 2.1e-04
o M=128 gluon m128 n64 k128 st3 w4 s3 a2: 21.0 us err 2.1e-04
o M=128 gluon m64 n128 k64 st4 w4 s1 a2: 22.0 us err 2.1e-04
o M=128 gluon m128 n128 k64 st3 w4 s1 a2: 5.0 us err 2.1e-04
{'layer': 'o', 'M': 128, 'cublas': 23.5}
o M=512 gluon m64 n128 k64 st4 w4 s1 a2: 1.0 us err 2.1e-04
"""


def test_scores_sum_each_tiles_best_split_and_drop_tiles_not_timed_everywhere() -> None:
    totals = scores(LOG.splitlines(), {128})
    assert totals == {"128x64x128x3x4": 24.0 + 21.0, "64x128x64x4x4": 20.0 + 22.0}  # 128x128 lacks qkv
    assert min(totals, key=totals.get) == "64x128x64x4x4"
    assert scores(LOG.splitlines(), {256}) == {}
