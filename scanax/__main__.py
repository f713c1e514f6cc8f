"""``scanax`` console script: ``scanax demo``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        print(
            "scanax bench: the benchmarks live in scanax's source checkout, not in "
            "the installed package: run `python -m benchmarks` there (options: "
            "--quick, --only NAME, --out DIR).",
            file=sys.stderr,
        )
        return 2
    if argv[:1] != ["demo"]:
        print("usage: scanax demo [options]", file=sys.stderr)
        return 2
    from ._demo import main as demo_main

    return demo_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
