// Clang's thread-safety annotations, so that the compiler checks which mutex
// guards which state instead of a comment saying so (leveldb and abseil do
// the same). Under clang with -Wthread-safety (scripts/thread_safety.sh, the
// CI lane thread_safety_lane) a read or write of a PMSNAP_GUARDED_BY member
// without its mutex held, or a call of a PMSNAP_REQUIRES function without
// the mutex, is an error. Other compilers see nothing.
//
// Use them with pmsnap::Mutex, MutexLock and CondVar (mutex.h): std::mutex
// itself carries no annotations in libstdc++.
#pragma once

#if defined(__clang__)
#define PMSNAP_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define PMSNAP_THREAD_ANNOTATION(x)
#endif

// A class whose objects are capabilities (a mutex).
#define PMSNAP_CAPABILITY(name) PMSNAP_THREAD_ANNOTATION(capability(name))
// A RAII class that holds a capability for its lifetime.
#define PMSNAP_SCOPED_CAPABILITY PMSNAP_THREAD_ANNOTATION(scoped_lockable)
// A member read or written only with `mutex` held.
#define PMSNAP_GUARDED_BY(mutex) PMSNAP_THREAD_ANNOTATION(guarded_by(mutex))
// A pointer member whose pointee is read or written only with `mutex` held.
#define PMSNAP_PT_GUARDED_BY(mutex) PMSNAP_THREAD_ANNOTATION(pt_guarded_by(mutex))
// A function called with the mutexes held (it does not take them).
#define PMSNAP_REQUIRES(...) PMSNAP_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
// A function called without the mutexes held (it takes them).
#define PMSNAP_EXCLUDES(...) PMSNAP_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define PMSNAP_ACQUIRE(...) PMSNAP_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define PMSNAP_RELEASE(...) PMSNAP_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define PMSNAP_TRY_ACQUIRE(...) PMSNAP_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define PMSNAP_ASSERT_CAPABILITY(mutex) PMSNAP_THREAD_ANNOTATION(assert_capability(mutex))
// Turns the analysis off for one function; say why beside it.
#define PMSNAP_NO_THREAD_SAFETY_ANALYSIS PMSNAP_THREAD_ANNOTATION(no_thread_safety_analysis)
