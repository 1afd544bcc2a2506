"""`python -m pmsnap COMMAND POOL ...`: the pmsnap command line.

  info, verify                the C++ commands (tools/cli.cc, also the `pmsnap`
                              executable): same output and exit codes
  list, export, prune, diff   the Python ones (pmsnap/cli.py): they need torch

Exit codes: 0 success, 1 damaged or unreadable pool or any other error (the
message names the pool), 2 usage error. `pip install .` also installs this
as the `pmsnap` command.
"""

import os
import sys

from . import _pmsnap
from . import cli


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in cli.COMMANDS:
        try:
            return cli.main(args)
        except BrokenPipeError:
            # `pmsnap list POOL | head`: the reader left; say nothing more.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141  # as a shell reports SIGPIPE

    code, out, err = _pmsnap.run_cli(args)
    sys.stdout.write(out)
    if code == 2 and not any(a in ("-h", "--help") for a in args):
        err += ("       pmsnap list|export|prune|diff ...   (python -m pmsnap COMMAND --help)\n")
    elif any(a in ("-h", "--help") for a in args):
        out = ("  list    the retained checkpoints (epoch, iteration, time, bytes, policy)\n"
               "  export  write a checkpoint as .safetensors, .pt or a DCP folder\n"
               "  prune   keep only the newest N retained epochs\n"
               "  diff    per-tensor max-abs and L2 differences of two epochs\n")
        sys.stdout.write(out)
    sys.stderr.write(err)
    return code


if __name__ == "__main__":
    sys.exit(main())
