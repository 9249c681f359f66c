"""`nfjax` command line: one subcommand per module, each exposing `add_parser(sub)` and `run(args)`."""
from __future__ import annotations

import argparse
import importlib
import sys

from nfjax.errors import UserError

SUBCOMMANDS = {
    "generate": "nfjax.commands.generate",
    "convert": "nfjax.checkpoint.convert",
    "train-tiny": "nfjax.train_tiny",
    "serve": "nfjax.commands.serve",
    "autosearch": "nfjax.commands.autosearch",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nfjax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, modname in SUBCOMMANDS.items():
        mod = importlib.import_module(modname)
        mod.add_parser(sub, name)
        modules[name] = mod
    args = parser.parse_args(argv)
    from nfjax import pinned_pool                # before any device starts: only the GPU client's start reads it
    pinned_pool.for_args(args, log=lambda m: print(f"nfjax {args.command}: {m}", file=sys.stderr))
    return run_command(modules[args.command].run, args, f"nfjax {args.command}")


def run_command(run, args: argparse.Namespace, prog: str) -> int:
    """Run a subcommand: user errors become one stderr line and exit code 2, Ctrl-C exit code 130."""
    try:
        return run(args) or 0
    except KeyboardInterrupt:
        return 130
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
