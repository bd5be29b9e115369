"""Tensor parallelism over ``torch.distributed``: process group, sharded layers, weight slicing,
the rank>0 worker loop and the launcher that starts one process per device.

Without a ``TPGroup`` (the default, ``tensor_parallel_size=1``) the factories in
``parallel_linear`` build the plain single-process modules and nothing calls ``torch.distributed``.
"""
