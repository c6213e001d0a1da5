"""`python -m qwen3_scratch.generate`: the qwen3-generate command (cli/generate.py).

Only an entry point: nothing imports this module, so no library module is ever also `__main__`.
"""

if __name__ == "__main__":
    from qwen3_scratch.cli.generate import entry

    entry()
