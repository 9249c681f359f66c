#!/usr/bin/env python
"""Thin entry point: `python serve.py [--model PATH] [--host H] [--port P] ...` (same flags as `nfjax serve`)."""
import argparse
import sys

from nfjax.commands import serve
from nfjax.errors import UserError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="serve.py", description=serve.__doc__.splitlines()[0])
    serve.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return serve.run(args) or 0
    except KeyboardInterrupt:
        return 130
    except UserError as e:
        print(f"serve.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
