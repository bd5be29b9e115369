"""``qserve bench``: a load test against any OpenAI-compatible server, over HTTP with streaming.

Modules: ``dataset`` (the seeded ShareGPT-like synthetic workload, ShareGPT JSON or a JSONL of
prompts), ``tokens`` (token ids and text for prompts: a local tokenizer or the server's
``/tokenize`` / ``/detokenize``), ``client`` (one streamed request, timed chunk by chunk), ``load``
(arrivals: concurrency caps, rates and burstiness), ``metrics`` (vLLM ``bench serve``'s summary
fields, goodput), ``prom`` (the server's own ``/metrics`` histograms, to cross-check the client's
numbers), ``report`` (table, vLLM's flat result JSON, PNG).
Nothing here imports torch or the engine: the bench is a client, and runs wherever httpx does.
"""
