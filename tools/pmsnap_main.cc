// `pmsnap`: inspect and verify checkpoint pools (see pmsnap/tools/cli.h).
#include <iostream>
#include <string>
#include <vector>

#include "pmsnap/tools/cli.h"

int main(int argc, char** argv) {
  return pmsnap::tools::RunCli(std::vector<std::string>(argv + 1, argv + argc), std::cout,
                               std::cerr);
}
