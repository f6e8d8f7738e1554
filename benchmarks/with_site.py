"""Run a module or a script with one more site directory (its ``.pth`` files processed).

    python3 benchmarks/with_site.py /tmp/fa4site -m evoengine search --kind bwd ...
    python3 benchmarks/with_site.py /tmp/fa4site benchmarks/retime.py --points ...

FlashAttention-4's wheels are installed on the device with ``pip --target DIR``, and its
CuTe DSL packages register themselves through ``.pth`` files there, which ``PYTHONPATH`` does
not read; ``site.addsitedir`` does. A directory that does not exist adds nothing (FA4 is then
skipped where it is an anchor, with its one-line note).
"""

from __future__ import annotations

import runpy
import site
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 2 or (argv[1] == "-m" and len(argv) < 3):
        sys.exit("usage: with_site.py DIR (-m MODULE | SCRIPT) [ARGS...]")
    site.addsitedir(argv[0])
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
