"""What the agent-framework examples share (no dependency but the standard library): distinct long
contexts (a report of numbered facts, different for every workflow seed, and a question about it),
their common command-line flags and their output, one JSON line per workflow."""

from __future__ import annotations

import argparse
import json
import random
from typing import Callable

CITIES = ("Lyon", "Porto", "Graz", "Turku", "Ghent", "Bergen", "Split", "Brno", "Cork", "Basel")
GOODS = ("apples", "pears", "cables", "lamps", "chairs", "books", "tiles", "coats")


def report(seed: int, words: int = 1100) -> tuple[str, str]:
    """(a report of about ``words`` words, a question about it); the same seed gives the same text."""
    rng = random.Random(seed)
    lines, n = [f"Warehouse report #{seed}."], 0
    while n < words:
        city, good = rng.choice(CITIES), rng.choice(GOODS)
        line = (
            f"Depot {len(lines)} in {city} shipped {rng.randint(10, 990)} {good} on day "
            f"{rng.randint(1, 28)} and kept {rng.randint(0, 99)} in stock."
        )
        lines.append(line)
        n += len(line.split())
    question = f"Which city shipped the most {rng.choice(GOODS)} in total, and how many?"
    return "\n".join(lines), question


def app_parser(doc: str) -> argparse.ArgumentParser:
    """The flags every example takes (its docstring's first line as the description)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    p.add_argument("--workflows", type=int, default=1)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument(
        "--words", type=int, default=1100, help="length of each workflow's report in words (1100: about 2K tokens)"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME:VALUE",
        help="another default header (e.g. X-KVShare-Method:none to opt out)",
    )
    return p


def print_workflows(args: argparse.Namespace, run: Callable[[int, dict], dict]) -> None:
    """``run(seed, headers)`` for each of the ``--workflows`` seeds, one JSON line each."""
    headers = dict(h.split(":", 1) for h in args.header)
    for seed in range(args.first_seed, args.first_seed + args.workflows):
        print(json.dumps(run(seed, headers)), flush=True)
