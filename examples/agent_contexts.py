"""Distinct long contexts for the agent-framework examples (no dependency but the standard library):
a report of numbered facts, different for every workflow seed, and a question about it."""

from __future__ import annotations

import random

CITIES = ("Lyon", "Porto", "Graz", "Turku", "Ghent", "Bergen", "Split", "Brno", "Cork", "Basel")
GOODS = ("apples", "pears", "cables", "lamps", "chairs", "books", "tiles", "coats")


def report(seed: int, words: int = 1100) -> tuple[str, str]:
    """(a report of about ``words`` words, a question about it); the same seed gives the same text."""
    rng = random.Random(seed)
    lines, n = [f"Warehouse report #{seed}."], 0
    while n < words:
        city, good = rng.choice(CITIES), rng.choice(GOODS)
        line = (f"Depot {len(lines)} in {city} shipped {rng.randint(10, 990)} {good} on day "
                f"{rng.randint(1, 28)} and kept {rng.randint(0, 99)} in stock.")
        lines.append(line)
        n += len(line.split())
    question = f"Which city shipped the most {rng.choice(GOODS)} in total, and how many?"
    return "\n".join(lines), question
