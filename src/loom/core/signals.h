// Asynchronous signals and the threads that compute (docs/operations.md "Signals").
//
// A signal handler runs on whichever thread the kernel picks among those that do not block the
// signal, on that thread's stack, at whatever instruction it was executing. oneDNN's JIT sgemm
// kernels (jit_avx512_common_gemm_f32, jit_avx_gemm_f32: Debian 12's oneDNN 2.6 and every release
// before 3.11.1) point the stack pointer into a heap workspace while they run, so the kernel
// writes the signal frame, and the handler its own frame, into the heap: "corrupted size vs.
// prev_size" at the next free(), with any handler at all, a no-op one included (oneDNN issue
// #4845, fixed by its pull request #4855 in 2026). So no thread that computes may ever run a
// handler.
//
// route_signals_to_one_thread() blocks every asynchronous signal (all but the synchronous faults
// SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT and SIGPIPE, which a thread raises on
// itself) in the calling thread, and so in every thread it creates later (OpenMP's and oneDNN's
// workers, the server's, the checkpoint writer), then starts one thread that blocks none of them
// and computes nothing: the kernel delivers every process-directed signal there, where Loom's
// handlers (or a profiler's, or a preloaded library's) run on an ordinary stack, and where a
// default action (terminate, core, stop) takes the whole process as before. Handlers therefore
// only record (an atomic flag, a byte into a pipe); the main loop acts on what they recorded.
#pragma once

#include <csignal>

namespace loom {

// Call before any thread exists: before main, since OpenBLAS (LAPACK's, linked for LDAdam) starts
// its thread pool in its library constructor. LOOM_BLOCK_SIGNALS_BEFORE_LIBRARIES does that from
// the executable's .preinit_array, which the dynamic loader runs before every shared library's
// constructor (ELF gABI, DT_PREINIT_ARRAY); it only sets the mask. The signal-handling thread is
// started by start_signal_thread() once the command has installed its handlers, so that a signal
// that arrived earlier (it stays pending, across the re-execution of core/threads.h too) finds them.
void block_async_signals();

// In the executable (one translation unit): block_async_signals() before any library initializes.
#define LOOM_BLOCK_SIGNALS_BEFORE_LIBRARIES                                                      \
  extern "C" void loom_block_signals_preinit(int, char**, char**) { ::loom::block_async_signals(); } \
  __attribute__((section(".preinit_array"), used)) void (*const loom_block_signals_preinit_entry)(int, char**, char**) = \
      loom_block_signals_preinit;
void start_signal_thread();

// Before execv of this same program: the next image's block_async_signals() takes the original
// mask from the environment instead of the (blocked) one it inherits.
void keep_original_signal_mask_across_exec();

// The mask the process had before block_async_signals() (for a child process before exec).
const sigset_t& original_signal_mask();

// For the lifetime of the object the calling thread has the original mask, so that a child it
// starts (popen, posix_spawn) does not inherit blocked signals. Use only around such calls.
class OriginalSignalMask {
 public:
  OriginalSignalMask();
  ~OriginalSignalMask();
  OriginalSignalMask(const OriginalSignalMask&) = delete;
  OriginalSignalMask& operator=(const OriginalSignalMask&) = delete;

 private:
  sigset_t saved_;
};

}  // namespace loom
