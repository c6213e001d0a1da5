"""The model: Qwen3's maths, and nothing else.

config.py (config.json -> Qwen3Config), rope.py (RoPE, plain and YaRN), qwen3.py (RMSNorm, attention
with q/k-norm, SwiGLU, the model: token ids -> logits), moe.py (Qwen3-MoE's sparse MLP), kv_cache.py
(the static cache and masks the model's forward takes) and sizes.py (the published shapes).

May import: the package root (errors, files). Imported by every layer above: kernels, checkpoint,
parallel, generation, engine. It never sees text, files of weights, sampling or a scheduler.
"""
