#!/usr/bin/env python
"""Thin entry point: `python serve.py [--model PATH] [--host H] [--port P] ...` (same flags as `nfjax serve`)."""
import argparse
import sys

from nfjax.cli import run_command
from nfjax.commands import serve


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="serve.py", description=serve.__doc__.splitlines()[0])
    serve.add_arguments(parser)
    return run_command(serve.run, parser.parse_args(argv), "serve.py")


if __name__ == "__main__":
    sys.exit(main())
