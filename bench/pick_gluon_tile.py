"""Issue 26: pick the Gluon W4A16 candidate that a bench/w4a16_gluon.py log timed fastest over a set of
row counts, as a ``QSERVE_W4A16_GLUON_TILE`` value, so that one device call can run the layer bench and
then the engine with its winner (the engine run is the measurement; this only chooses what it runs).

Knows: the log lines bench/w4a16_gluon.py prints per candidate (``<layer> M=<m> gluon m<bm> n<bn> k<bk>
st<stages> w<warps> s<split> a<ahead>: <µs> us err <e>``). Must not know: the kernel.

A candidate's score is its summed µs over every (layer, M) of ``--ms`` (each layer once, as in a decoder
layer); the candidate must have been timed at every one of them. The split (``s``) is not part of the
tile: the engine's ``auto_split`` picks it, so a tile's best split at each (layer, M) counts. Row counts
under a candidate's block_m fit it smaller (bench ``fit``): pass row counts at or past every block_m.
Prints the winning ``block_m x block_n x block_k x stages x warps`` and the table of scores to stderr.

    python3 bench/pick_gluon_tile.py $OUT/bench.log --ms 128,256 [--baseline 128x64x128x3x4]
"""

from __future__ import annotations

import argparse
import re
import sys

LINE = re.compile(
    r"^(?P<layer>\w+) M=(?P<m>\d+) gluon m(?P<bm>\d+) n(?P<bn>\d+) k(?P<bk>\d+) st(?P<st>\d+) w(?P<w>\d+) "
    r"s(?P<split>\d+) a(?P<ahead>\d+): (?P<us>[0-9.]+) us"
)


def scores(lines: list[str], ms: set[int]) -> dict[str, float]:
    """``{tile: summed µs}`` over the (layer, M) pairs every tile was timed at (its best split each)."""
    best: dict[tuple[str, tuple[str, int]], float] = {}
    for line in lines:
        hit = LINE.match(line.strip())
        if not hit or int(hit["m"]) not in ms:
            continue
        # the tile as the engine's switch names it
        tile = f"{hit['bm']}x{hit['bn']}x{hit['bk']}x{hit['st']}x{hit['w']}"
        key = (tile, (hit["layer"], int(hit["m"])))
        best[key] = min(best.get(key, float("inf")), float(hit["us"]))
    pairs = {pair for _, pair in best}
    totals: dict[str, float] = {}
    for tile in {tile for tile, _ in best}:
        if all((tile, pair) in best for pair in pairs):
            totals[tile] = sum(best[(tile, pair)] for pair in pairs)
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--ms", default="128,256")
    ap.add_argument("--baseline", default="128x64x128x3x4", help="the built-in tile, printed if it wins")
    args = ap.parse_args()
    with open(args.log) as f:
        totals = scores(f.readlines(), {int(m) for m in args.ms.split(",")})
    if not totals:
        sys.exit(f"{args.log}: no candidate timed at every layer and M of {args.ms}")
    for tile, total in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"{tile}: {total:.1f} us", file=sys.stderr)
    print(min(totals, key=totals.get))


if __name__ == "__main__":
    main()
