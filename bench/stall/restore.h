// bench/stall's restores: the newest checkpoint restored as after a crash,
// each time in a fresh process of this program (--restore-child) that builds
// the model as a restarted trainer would, pmsnap from the pool (verified and
// not) against torch::load of the torch-save file.
//
// Thread-safety: the main thread.
#pragma once

#include <string>

#include "stall/options.h"
#include "stall/results.h"

namespace pmsnap::bench::stall {

// The child's side: builds o.workloads.front(), times the restore the
// --restore-* flags name, prints "restore-sample <open s> <restore s>
// <bytes>" on stdout. 0 on success; 2 for a bad workload or device, 3 when
// the restore fails (message on stderr).
int RunRestoreChild(const Options& o);

// The parent's side: o.restore_rounds rounds, the methods taking turns, of
// restores of `pool` (when it exists) and `file` (likewise) for `workload`
// on the device `device_spec` (runtime::MakeDevice), appended to
// results->restores under `device_label`, and printed. A method whose child
// fails is reported and not run again.
void MeasureRestores(const Options& o, const std::string& workload, const std::string& device_spec,
                     const std::string& device_label, const std::string& pool,
                     const std::string& file, Results* results);

}  // namespace pmsnap::bench::stall
