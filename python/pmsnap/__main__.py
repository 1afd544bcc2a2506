"""`python -m pmsnap info|verify POOL [--json]`: the pmsnap command line.

The same C++ code as the `pmsnap` executable (tools/cli.cc), so the output
and exit codes are the same: 0 success, 1 damaged or unreadable pool, 2
usage error.
"""

import sys

from . import _pmsnap


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    code, out, err = _pmsnap.run_cli(args)
    sys.stdout.write(out)
    sys.stderr.write(err)
    return code


if __name__ == "__main__":
    sys.exit(main())
