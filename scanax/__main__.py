"""``scanax`` console script: ``scanax demo`` and ``scanax bench``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("demo", "bench"):
        print("usage: scanax {demo,bench} [options]", file=sys.stderr)
        return 2
    if argv[0] == "demo":
        from ._demo import main as demo_main

        return demo_main(argv[1:])
    from ._bench import main as bench_main

    return bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
