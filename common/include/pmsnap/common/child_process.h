// ChildProcess: a program started with posix_spawn, its stdout on a pipe the
// parent reads line by line, SIGKILLed at will. Crash tests and the demo use
// it to kill a trainer at a chosen step; posix_spawn (not fork) keeps
// libtorch's thread pools out of the child.
//
// Thread-safety: one owner thread.
#pragma once

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

extern char** environ;

namespace pmsnap {

class ChildProcess {
 public:
  // argv[0] is the program's path; the child inherits the environment.
  explicit ChildProcess(std::vector<std::string> argv) {
    int fds[2];
    if (::pipe(fds) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    posix_spawn_file_actions_addclose(&actions, fds[1]);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    if (posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    out_ = ::fdopen(fds[0], "r");
  }
  // A child still running is killed and reaped.
  ~ChildProcess() {
    if (pid_ > 0) {
      Kill();
      Wait();
    }
    if (out_ != nullptr) std::fclose(out_);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  bool started() const { return pid_ > 0 && out_ != nullptr; }
  // Next line of the child's stdout without the newline; false at EOF.
  bool ReadLine(std::string* line) {
    char* buffer = nullptr;
    std::size_t capacity = 0;
    const ssize_t n = ::getline(&buffer, &capacity, out_);
    if (n >= 0) line->assign(buffer, static_cast<std::size_t>(n));
    std::free(buffer);
    if (n < 0) return false;
    if (!line->empty() && line->back() == '\n') line->pop_back();
    return true;
  }
  void Kill() { ::kill(pid_, SIGKILL); }
  // Exit status, or -signal if a signal ended it; -1000 if it never started.
  int Wait() {
    if (pid_ <= 0) return -1000;
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
};

}  // namespace pmsnap
