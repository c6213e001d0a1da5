"""From a name or a folder to a ready model: the checkpoint's files, read as untrusted input.

hub.py (`--model` -> a folder, downloading a Hub id), snapshot.py and download.py (the verified
download), shards.py (one safetensors shard, validated by the `safetensors` library), weights.py
(`load_model`: the strict load into model/, then the layout from kernels/), placement.py (which
device and dtype "auto" means, one rule for everything).

May import: model, kernels, the package root. Imported by: parallel, generation, engine, cli.
"""
