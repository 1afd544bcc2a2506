// The `pmsnap` command line: inspect and verify checkpoint pools.
//
//   pmsnap info POOL [--json]     format, model signature, units, both slots
//   pmsnap verify POOL [--json]   deep checksum check; exit 0 consistent, 1 not
//
// One implementation for the C++ executable (tools/pmsnap_main.cc) and
// `python -m pmsnap` (the binding's run_cli), so both print the same.
// list, export, prune and diff need torch and live in the Python package
// (python/pmsnap/cli.py); here they exit 2 with a message pointing there.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace pmsnap::tools {

// Runs the command line `args` (without the program name): reports go to
// `out`, errors and usage to `err`. Returns the exit code: 0 success, 1
// damaged or unreadable pool (the message names the pool), 2 usage error.
// Opens pools read-only in effect (nothing is written); any thread.
int RunCli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace pmsnap::tools
