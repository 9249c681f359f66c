#!/usr/bin/env python
"""Thin entry point: `python serve.py [--model PATH] [--host H] [--port P] ...` (same as `nfjax serve`)."""
import sys

from nfjax.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
