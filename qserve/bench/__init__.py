"""``qserve bench``: a load test against any OpenAI-compatible server, over HTTP with streaming.

Modules: ``dataset`` (the seeded ShareGPT-like synthetic workload or a JSONL of prompts),
``client`` (one streamed request, timed chunk by chunk), ``load`` (arrivals: concurrency caps
and Poisson rates), ``metrics`` (vLLM ``bench serve``'s summary fields), ``prom`` (the server's
own ``/metrics`` histograms, to cross-check the client's numbers), ``report`` (table, JSON, PNG).
Nothing here imports torch or the engine: the bench is a client, and runs wherever httpx does.
"""
