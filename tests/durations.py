"""Write tests/durations.json (each test file's seconds, which `tests/conftest.py` schedules
longest first) from the JUnit XML of a whole run:

    scripts/dev test --junitxml=/tmp/run.xml && scripts/dev durations /tmp/run.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parent / "durations.json"


def per_file(junit: str) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown of its tests)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname "tests.test_x" or "tests.test_x.TestClass": the file is its module
        while module and not module[-1].startswith("test_"):
            module.pop()
        if module:
            seconds["/".join(module) + ".py"] += float(case.get("time", 0))
    return dict(seconds)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    files = per_file(argv[0])
    OUT.write_text(json.dumps({k: round(v, 1) for k, v in
                               sorted(files.items(), key=lambda kv: -kv[1])}, indent=1) + "\n")
    print(f"{OUT}: {len(files)} files, {sum(files.values()) / 60:.1f} min in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
