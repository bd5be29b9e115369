"""Tensor parallelism over ``torch.distributed``: process group, sharded layers, weight slicing and
the rank>0 step loop. The launcher that starts one process per device builds engines, so it lives
above, in ``qserve.engine.tensor_parallel``.

Without a ``TPGroup`` (the default, ``tensor_parallel_size=1``) the factories in
``parallel_linear`` build the plain single-process modules and nothing calls ``torch.distributed``.
"""
