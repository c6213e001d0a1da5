"""Tensor parallelism (and expert parallelism for MoE): one model split over N processes and devices.

plan.py (which slice of every weight a rank holds; impossible sizes refused), layers.py (row-parallel
linears, vocab-parallel embedding and lm_head, expert-parallel MoE: the modules that communicate),
loading.py (a rank reads only its slices of the safetensors shards), group.py (rank 0 here, ranks
1..N-1 spawned; torch.distributed groups with timeouts; a dead or hung rank ends the run in one line),
ranks.py (how a process joins: the rendezvous, the groups, its device), worker.py (what ranks 1..N-1 run: rank 0's steps, with mirrors of its caches) and model.py
(`load_parallel_model`, and rank 0's model, which the loops and the engine use as they use a Qwen3).

May import: model, kernels, checkpoint, the package root. Imported by: generation, engine, cli.
"""
