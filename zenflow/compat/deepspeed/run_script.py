"""Run a DeepSpeed script with the `deepspeed` names served by zenflow (each process that
`zenflow launch` starts runs this):

    python -m zenflow.compat.deepspeed.run_script [--no_local_rank] script.py [script args...]

As DeepSpeed's launcher does, the script gets `--local_rank=<LOCAL_RANK>` appended to its
arguments unless --no_local_rank is given. Rank 0 prints once which names are served.
"""
from __future__ import annotations

import os
import runpy
import sys

from zenflow.compat.deepspeed.serve import serve_deepspeed_imports


def main(argv: list[str]) -> None:
    pass_local_rank = True
    if argv and argv[0] == "--no_local_rank":
        pass_local_rank, argv = False, argv[1:]
    if not argv:
        sys.exit("usage: python -m zenflow.compat.deepspeed.run_script [--no_local_rank] "
                 "script.py [args...]")
    script, args = argv[0], argv[1:]
    served = serve_deepspeed_imports()
    if os.environ.get("RANK", "0") == "0":
        print(f"zenflow launch: serving {', '.join(served)} from zenflow; other deepspeed.* "
              "names are refused by name", file=sys.stderr, flush=True)
    if pass_local_rank:
        args = [*args, f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"]
    # As `python script.py` would: argv, and the script's directory first on the path.
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
