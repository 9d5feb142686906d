// The kernels' threads: one persistent team, shared by every kernel of the library.
//
// `parallel_for(n, f)` runs f(0) … f(n-1) on the calling thread and the team's workers.  Chunks
// are claimed one at a time from a shared counter, so the caller never waits for a worker that
// has not woken up yet: it takes the chunks itself, and waits only for chunks a worker already
// runs.  A late or descheduled worker (a busy machine, a sleeping thread) therefore costs at most
// one chunk, where an OpenMP region would wait for every thread at its barrier.  Between calls a
// worker spins for `spin_us` microseconds (awake through the back-to-back kernels of a step; it
// yields now and then, so another process's thread waiting for the core runs), then sleeps on a
// futex until the next call wakes it.
#pragma once

#include <cstdint>
#include <type_traits>

namespace team {

using ChunkFn = void (*)(void* ctx, int64_t chunk);

// Run fn(ctx, i) for every i in [0, chunks); returns when all have returned.
void run(int64_t chunks, ChunkFn fn, void* ctx);

// Threads in the team, the caller included.
int size();

// While a Hold lives, idle workers spin (yielding now and then) instead of sleeping: for a call
// that runs many kernels back to back (kernels/decode_stack.cpp), so none pays a wake-up.
struct Hold {
  Hold();
  ~Hold();
  Hold(const Hold&) = delete;
  Hold& operator=(const Hold&) = delete;
};

template <class F>
inline void parallel_for(int64_t chunks, F&& f) {
  using Fn = typename std::remove_reference<F>::type;
  run(chunks, [](void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); }, &f);
}

}  // namespace team
