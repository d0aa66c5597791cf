"""`minedraft bench`: load generator for a running server, and side-by-side comparison of the modes."""

from __future__ import annotations

import argparse


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="localhost:50051")


def bench_main(args: argparse.Namespace) -> int:
    raise NotImplementedError("being written")
