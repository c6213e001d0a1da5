"""Running `python -m qwen3_scratch.generate` in-process, and what every bad input must look like."""

from qwen3_scratch.cli.generate import main


def cli(capsys, *args):
    """(exit code, stdout, stderr) of the CLI with these arguments."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's own errors and --help/--version exit from parse_args
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *needles):
    """Bad input: exit 2, one line on stderr naming what was wrong (each needle), no traceback."""
    assert code == 2, f"bad input must exit 2, got {code}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, f"expected one line on stderr, got:\n{err}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} missing from: {lines[0]}"
