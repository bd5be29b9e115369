"""quant_kernels: the numeric core of qserve.

Knows: the canonical packed-weight layout, pure-PyTorch reference ops (the CPU path and the
test oracle) and, lazily imported, the Triton kernels. Must not know: engines, schedulers,
checkpoint formats or anything else in this repository.
"""
