"""`python -m qwen3_scratch.serve`: the qwen3-serve command (cli/serve.py).

Only an entry point: nothing imports this module, so no library module is ever also `__main__`.
"""

if __name__ == "__main__":
    from qwen3_scratch.cli.serve import main

    raise SystemExit(main())
