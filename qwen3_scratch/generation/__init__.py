"""The simple loops and `Pipeline`: one prompt or a fixed batch at a time, through the fastest batch-1 path.

loops.py (token ids in, token ids out: the full-recompute reference and the KV-cache loop),
conversation.py (multi-turn chat over a KV cache kept across turns), pipeline.py (`Pipeline`: text in,
text out), stats.py (the numbers a run reports), and speculative decoding: speculative.py (one round:
propose, check in one target forward, keep, roll back; the adaptive k) over two proposers,
sampling/prompt_lookup.py and draft_model.py.

May import: model, kernels, checkpoint, parallel, text, sampling, the package root. Imported by: cli.
The engine (engine/) is its sibling: neither imports the other.
"""
