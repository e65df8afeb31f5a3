// Clang thread-safety annotations (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html), as
// macros that expand to the attributes under clang and to nothing elsewhere. Internal: not part
// of the installed headers. scripts/thread_safety.sh builds the store and the tiers with
// `clang++ -Wthread-safety -Werror`, so a member marked TERRACE_GUARDED_BY(mu_) that is touched
// without mu_ held fails that build.
#pragma once

#if defined(__clang__)
#define TERRACE_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define TERRACE_THREAD_ANNOTATION(x)
#endif

// A class that is a lock (Mutex below).
#define TERRACE_CAPABILITY(name) TERRACE_THREAD_ANNOTATION(capability(name))
// An RAII class that holds a lock for its lifetime (MutexLock below).
#define TERRACE_SCOPED_CAPABILITY TERRACE_THREAD_ANNOTATION(scoped_lockable)
// A data member read or written only with the lock held.
#define TERRACE_GUARDED_BY(x) TERRACE_THREAD_ANNOTATION(guarded_by(x))
// A pointer member whose pointee is read or written only with the lock held.
#define TERRACE_PT_GUARDED_BY(x) TERRACE_THREAD_ANNOTATION(pt_guarded_by(x))
// Lock order: this lock is taken after / before the named ones (checked with -Wthread-safety-beta).
#define TERRACE_ACQUIRED_AFTER(...) TERRACE_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define TERRACE_ACQUIRED_BEFORE(...) TERRACE_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
// A function that must be called with the locks held, and returns with them held.
#define TERRACE_REQUIRES(...) TERRACE_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
// A function that must be called without the locks (it takes them itself).
#define TERRACE_EXCLUDES(...) TERRACE_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
// A function that takes / releases the locks (no argument on a member of a lock: the object).
#define TERRACE_ACQUIRE(...) TERRACE_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define TERRACE_RELEASE(...) TERRACE_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TERRACE_TRY_ACQUIRE(...) TERRACE_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
// A function after which the analysis takes the lock as held (Mutex::AssertHeld: no run-time check).
#define TERRACE_ASSERT_CAPABILITY(x) TERRACE_THREAD_ANNOTATION(assert_capability(x))
// A function that returns a reference to the lock.
#define TERRACE_RETURN_CAPABILITY(x) TERRACE_THREAD_ANNOTATION(lock_returned(x))
// Turns the analysis off for one function. Every use says, next to it, why the function is
// correct although the analysis cannot see it.
#define TERRACE_NO_THREAD_SAFETY_ANALYSIS TERRACE_THREAD_ANNOTATION(no_thread_safety_analysis)
