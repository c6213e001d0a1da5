"""The engine and `LLM`: many requests at once, continuous batching over a paged, prefix-cached KV pool.

block_manager.py (blocks, reference counts, the prefix cache), paged_cache.py (the pool and its gathering
view), scheduler.py (`Sequence`, `Scheduler`: one step's work), batch.py (a step's chunks packed into one
(1, N) varlen forward), packed_view.py (attention over the packed rows: decodes in place via
paged_attention.py on a CPU, FlexAttention over the pool via flex_paged.py on a GPU, the gathered reference),
buckets.py (the few sizes every step's shapes are padded to), cuda_graphs.py (decode steps replayed from a
CUDA graph per bucket), transfer.py (host <-> device copies that do not wait for the GPU), model_runner.py (one step -> one padded forward -> logits), sampler.py (each
sequence's next token: grammar mask, logit processing, draw, logprobs), engine.py (`LLMEngine`: add, step,
sample, retire), faults.py (a fault fails its own request, or the engine when shared state broke), embedder.py
(Qwen3-Embedding: texts -> last-token, L2-normalised vectors), snapshot.py (the engine at one instant as plain
data: its queues and the pool block by block, for the server's engine view) and llm.py (`LLM`, the offline API
in vLLM's shape: generate, chat, embed).

May import: model, checkpoint, parallel, text, sampling, the package root. Imported by: server, cli.
The simple loops (generation/) are its sibling: neither imports the other.
"""
