"""Text: token ids <-> text, and the structure Qwen3 writes into it. No model, no torch.

tokenizer.py (the checkpoint's BPE, streaming detokenizer, chat ids where only the template writes
control tokens), chat_template.py (the checkpoint's Jinja template in a sandbox), chat_parser.py
(generated ids -> reasoning, answer and tool calls), stop.py (stop strings), limits.py (how much text
a prompt may be), token_bytes.py (each token's raw bytes, for grammars and logprobs), bad_words.py
(`bad_words` as the token sequences to ban).

May import: the package root. Imported by: generation, engine, server, cli.
"""
