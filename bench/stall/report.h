// bench/stall's output: the CSV files the plots and tables read
// (stall_plot.py, stall_tables.py), the printed table and the targets.
//
// Thread-safety: plain functions.
#pragma once

#include <string>
#include <vector>

#include "stall/options.h"
#include "stall/results.h"

namespace pmsnap::bench::stall {

// <out>/<tag>.csv, <tag>_restore.csv and <tag>_trials.csv, creating <out>;
// their columns are the contract with the plot scripts.
void WriteCsv(const Options& o, const std::vector<Row>& rows,
              const std::vector<RestoreRow>& restores, const std::vector<std::string>& trial_lines);

// The summary table, the cold-start table and the restore table, on stdout.
void PrintTable(const Results& res);

// Each target of the issue (overhead, stall against CheckFreq, restore
// against torch::load) with MET or MISSED, on stdout.
void PrintTargets(const Results& res);

}  // namespace pmsnap::bench::stall
