// ParseCommandLine: the "--key=value" / "--flag" loop the benchmarks and the
// demo share. Each argument is split at its first '=' and handed to the
// caller's parser as (key, value); --help / -h prints the usage.
//
// Thread-safety: plain function.
#pragma once

#include <cstdio>
#include <exception>
#include <optional>
#include <string>

namespace pmsnap {

// `parse(key, value)` returns false for an unknown key; an exception it throws
// (std::stoi on a bad number) counts as a bad value. Returns the exit code to
// end the program with (0 after --help, 1 on a bad flag, with the usage on
// stderr), or nullopt when every argument was taken.
template <typename Parse>
std::optional<int> ParseCommandLine(int argc, char** argv, const char* program, const char* usage,
                                    Parse&& parse) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(usage, stdout);
      return 0;
    }
    const auto eq = arg.find('=');
    bool ok = false;
    try {
      ok = parse(arg.substr(0, eq), eq == std::string::npos ? std::string() : arg.substr(eq + 1));
    } catch (const std::exception&) {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "%s: bad flag %s\n%s", program, arg.c_str(), usage);
      return 1;
    }
  }
  return std::nullopt;
}

}  // namespace pmsnap
