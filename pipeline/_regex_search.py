"""A worker process for `pipeline.evals`: ``re.search`` on requests read from stdin.

A pattern that backtracks catastrophically (``^(a+)+$`` against ``"aaaa...b"``) runs for
years and cannot be interrupted in-process (``re`` holds the GIL while it matches), so
evaluations search in this process and kill it when a search overruns its time limit.

It runs as a script (``python -I -S path``) and imports only the standard library. Each
request is one line of JSON, ``{"pattern": ..., "text": ...}``; each answer one line,
``1`` (found) or ``0``. It ends when its stdin closes.
"""

from __future__ import annotations

import json
import re
import sys


def main() -> None:
    for line in sys.stdin:  # one request a line, until the parent closes the pipe
        request = json.loads(line)
        found = re.search(request["pattern"], request["text"]) is not None
        sys.stdout.write("1\n" if found else "0\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
