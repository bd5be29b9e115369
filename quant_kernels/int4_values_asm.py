"""The PTX that turns a 32-bit word of eight 4-bit codes into eight fp16 / bf16 values ``q - 8``: one
text for every W4A16 kernel that unpacks in registers (``w4a16_mma_triton``'s ``_values_fast4``, the
Gluon kernel's ``_values4``), so they unpack alike.

Knows: the PTX and the value order it produces (word-value order v0..v7 as outputs ``$0..$7``, the word
as ``$8``). Must not know: Triton, layouts, kernels (each kernel wraps the text as its own constexpr).

bf16: ``(w >> 4i) & 0x000F000F | magic`` is the half2 ``128 + q`` and one fma removes ``128 + 8``. fp16: the
nibbles at bits 4-7 / 20-23 are taken in place, as ``1024 + 16 q`` (exact below 2048), and one fma by 1/16
with -(64 + 8) gives ``q - 8``: 9 instructions per word, not 11.
"""

BF16_VALUES4 = (
    "{ .reg .b32 t0, t1, t2, t3, s0, s1, s2, one, nz; mov.b32 one, 0x3f803f80; mov.b32 nz, 0xc308c308; "
    "lop3.b32 t0, $8, 0x000f000f, 0x43004300, 0xea; "
    "shr.u32 s0, $8, 4; lop3.b32 t1, s0, 0x000f000f, 0x43004300, 0xea; "
    "shr.u32 s1, $8, 8; lop3.b32 t2, s1, 0x000f000f, 0x43004300, 0xea; "
    "shr.u32 s2, $8, 12; lop3.b32 t3, s2, 0x000f000f, 0x43004300, 0xea; "
    "fma.rn.bf16x2 t0, t0, one, nz; fma.rn.bf16x2 t1, t1, one, nz; "
    "fma.rn.bf16x2 t2, t2, one, nz; fma.rn.bf16x2 t3, t3, one, nz; "
    "mov.b32 {$0, $1}, t0; mov.b32 {$2, $3}, t1; mov.b32 {$4, $5}, t2; mov.b32 {$6, $7}, t3; }"
)
FP16_VALUES4 = (
    "{ .reg .b32 t0, t1, t2, t3, s1, z, m, c; "
    "mov.b32 z, 0x64086408; mov.b32 m, 0x2c002c00; mov.b32 c, 0xd480d480; "
    "lop3.b32 t0, $8, 0x000f000f, 0x64006400, 0xea; "
    "lop3.b32 t1, $8, 0x00f000f0, 0x64006400, 0xea; "
    "shr.u32 s1, $8, 8; lop3.b32 t2, s1, 0x000f000f, 0x64006400, 0xea; "
    "lop3.b32 t3, s1, 0x00f000f0, 0x64006400, 0xea; "
    "sub.f16x2 t0, t0, z; fma.rn.f16x2 t1, t1, m, c; sub.f16x2 t2, t2, z; fma.rn.f16x2 t3, t3, m, c; "
    "mov.b32 {$0, $1}, t0; mov.b32 {$2, $3}, t1; mov.b32 {$4, $5}, t2; mov.b32 {$6, $7}, t3; }"
)
