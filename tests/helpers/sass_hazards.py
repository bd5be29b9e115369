"""The wgmma A-operand hazard checker over sm90 SASS (nvdisasm ``-c`` output), shared by the W4A16 kernels'
SASS tests (tests/kernels/test_w4a16_sass.py, test_w4a16_wgmma_gluon.py).

Knows: SASS text, HGMMA / WARPGROUP.DEPBAR semantics. Must not know: any kernel.
"""

from __future__ import annotations

import re

_PRED = re.compile(r"^@!?U?P[T\d]+\s+")
# ops that write no general register (or whose first operand is not a destination)
_NO_DEST = (
    "ST", "BAR", "BRA", "WARPGROUP", "LDGSTS", "DEPBAR", "LDGDEPBAR", "RED", "HGMMA", "EXIT", "RET",
    "WARPSYNC", "NOP", "MEMBAR", "FENCE", "ERRBAR", "CCTL", "SYNCS", "ARRIVES", "CALL",
)  # fmt: skip


def _instructions(sass: str) -> list[tuple[int | None, str]]:
    out: list[tuple[int | None, str]] = []
    for line in sass.splitlines():
        if m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line):
            out.append((int(m.group(1), 16), m.group(2)))
        elif m := re.match(r"\.L_x_(\d+):", line):
            out.append((None, m.group(1)))
    return out


def _dest_regs(text: str) -> set[int]:
    op, _, rest = _PRED.sub("", text).partition(" ")
    if not rest or op.startswith(_NO_DEST):
        return set()
    m = re.match(r"R(\d+)$", rest.split(",")[0].strip())
    if not m:
        return set()
    if op.startswith("LDSM"):  # ldmatrix: .x4 / .x2 (".4" / ".2" in SASS) write that many registers
        width = 4 if op.endswith(".4") else 2 if op.endswith(".2") else 1
    elif ".128" in op:
        width = 4
    else:
        width = 2 if (op.startswith("IMAD.WIDE") or op.endswith(".64") or ".64." in op) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


_A_OPERAND = re.compile(r"HGMMA\S*\s+R\d+,\s*R(\d+),")  # an HGMMA whose A operand is a register quad


class _InFlight:
    """The A registers that issued HGMMAs read until their group retires, as instructions go by."""

    def __init__(self) -> None:
        self.pending: list[set[int]] = []  # A registers of each committed, unretired group, oldest first
        self.group: set[int] = set()  # issued HGMMAs not yet committed (no gsb0 yet) read theirs too

    def feed(self, text: str) -> tuple[bool, set[int]]:
        """(whether ``text`` is an HGMMA with a register A operand, the in-flight A registers it writes)."""
        t0 = _PRED.sub("", text)
        if t0.startswith("HGMMA"):
            ma = _A_OPERAND.match(t0)
            if ma:
                self.group |= set(range(int(ma.group(1)), int(ma.group(1)) + 4))
            if "gsb0" in t0:
                self.pending.append(self.group)
                self.group = set()
            return ma is not None, set()
        if mw := re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", t0):
            del self.pending[: max(0, len(self.pending) - int(mw.group(1), 16))]
            return False, set()
        return False, _dest_regs(text) & set().union(self.group, *self.pending)


def _hazard(addr: int, text: str, hit: set[int]) -> str:
    return f"{addr:#x} {text}  (A registers R{sorted(hit)[0]}.. of an unretired HGMMA)"


def a_operand_hazards(sass: str) -> tuple[int, list[str]]:
    """(HGMMAs with a register A operand seen in loops, writes to the A registers of in-flight ones)."""
    ins = _instructions(sass)
    labels = {text: i for i, (addr, text) in enumerate(ins) if addr is None}
    seen, found = 0, []
    for i, (addr, text) in enumerate(ins):
        m = re.search(r"BRA `\(\.L_x_(\d+)\)", text)
        if addr is None or not m or labels.get(m.group(1), i) >= i:
            continue
        body = [x for x in ins[labels[m.group(1)] + 1 : i + 1] if x[0] is not None]
        state = _InFlight()
        for lap in range(2):  # the second lap starts with what the back edge carries
            for a, t in body:
                register_a, hit = state.feed(t)
                seen += register_a and lap == 0
                if hit and lap == 1:
                    found.append(_hazard(a, t, hit))
    return seen, found


def hgmma_groups(sass: str) -> list[set[int]]:
    """The A registers of each committed HGMMA group (one ``gsb0`` commit each), in address order."""
    state = _InFlight()
    for addr, text in _instructions(sass):
        if addr is not None and _PRED.sub("", text).startswith("HGMMA"):
            state.feed(text)  # only HGMMAs: no group retires, so ``pending`` keeps every commit
    return state.pending


def fallthrough_a_operand_hazards(sass: str) -> list[str]:
    """Writes to the A registers of an unretired HGMMA group along the code in address order: the paths
    that enter a loop from code before it and leave it for code after it (``a_operand_hazards`` follows
    the back edges). Taken branches are not followed."""
    state, found = _InFlight(), []
    for addr, text in _instructions(sass):
        if addr is not None and (hit := state.feed(text)[1]):
            found.append(_hazard(addr, text, hit))
    return found
