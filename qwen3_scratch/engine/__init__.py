"""The engine and `LLM`: many requests at once, continuous batching over a paged, prefix-cached KV pool.

block_manager.py (blocks, reference counts, the prefix cache), paged_cache.py (the pool and the views
the model's attention reads through), paged_attention.py (a decode batch's attention over its blocks
in place, compiled), scheduler.py (`Sequence`, `Scheduler`: one step's work),
model_runner.py (one step -> forwards -> logits), engine.py (`LLMEngine`: add, step, sample, retire)
and llm.py (`LLM`, the offline API in vLLM's shape).

May import: model, checkpoint, text, sampling, the package root. Imported by: server, cli.
The simple loops (generation/) are its sibling: neither imports the other.
"""
