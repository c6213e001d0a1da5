"""The engine and `LLM`: many requests at once, continuous batching over a paged, prefix-cached KV pool.

block_manager.py (blocks, reference counts, the prefix cache), paged_cache.py (the pool and the views
the model's attention reads through), paged_attention.py (a decode batch's attention over its blocks
in place, compiled), scheduler.py (`Sequence`, `Scheduler`: one step's work), model_runner.py (one
step -> forwards -> logits), sampler.py (each sequence's next token: grammar mask, logit processing,
draw, logprobs), engine.py (`LLMEngine`: add, step, sample, retire), faults.py (a fault fails its own
request, or the engine when shared state broke), embedder.py (Qwen3-Embedding: texts -> last-token,
L2-normalised vectors), snapshot.py (the engine at one instant as plain data: its queues and the pool
block by block, for the server's engine view) and llm.py (`LLM`, the offline API in vLLM's shape:
generate, chat, embed).

May import: model, checkpoint, parallel, text, sampling, the package root. Imported by: server, cli.
The simple loops (generation/) are its sibling: neither imports the other.
"""
