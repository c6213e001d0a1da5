"""The commands: thin layers of argparse over the Python API.

generate.py (`qwen3-generate`, over Pipeline), chat.py (`qwen3-chat`, over Pipeline.chat_stream),
serve.py (`qwen3-serve`, over LLM and the server), flags.py (the flags and error handling they
share) and inputs.py (prompts from flags, files and stdin, bounded). Each flag maps to one library
parameter; nothing heavy is imported until a command runs, so `--help` is instant.

May import: every layer below. Imported by: the entry points `python -m qwen3_scratch.generate`
(generate.py at the package root), `.chat`, `.serve`, and the `qwen3-*` scripts.
"""
