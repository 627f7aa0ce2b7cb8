// sanitizer_options.cc: the runtime options of an instrumented build (cmake/Sanitizers.cmake),
// compiled into every executable so that the tests, the daemons they start and a binary run by
// hand need no environment. ASAN_OPTIONS / TSAN_OPTIONS set by hand still apply on top.
extern "C" {

#if defined(DFLASHD_SANITIZE_address)
// Leak checking is off: libtorch keeps its allocator caches and registries to the end of the
// process by design, and every report would be those.
const char* __asan_default_options() { return "detect_leaks=0:strict_string_checks=1:check_initialization_order=1"; }
const char* __ubsan_default_options() { return "print_stacktrace=1:halt_on_error=1"; }
#endif

#if defined(DFLASHD_SANITIZE_thread)
const char* __tsan_default_options() { return "halt_on_error=1:second_deadlock_stack=1:history_size=4"; }

// libgomp (ATen's OpenMP threads) is not instrumented: its barriers are invisible to TSan, so the
// interceptors it calls (memory allocation, copies) are not checked. Nothing else is suppressed:
// the suite runs clean without suppressions for libtorch, whose accesses TSan does not see at all.
const char* __tsan_default_suppressions() {
  return "called_from_lib:libgomp.so.1\n";
}
#endif

}  // extern "C"
