"""`python -m qwen3_scratch.chat`: the qwen3-chat command (cli/chat.py).

Only an entry point: nothing imports this module, so no library module is ever also `__main__`.
"""

if __name__ == "__main__":
    from qwen3_scratch.cli.chat import entry

    entry()
