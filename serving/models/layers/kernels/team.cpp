// The team behind team::run (see team.h).
//
// One 64-bit word holds the current job: its number (32 bits), its chunk count and the next
// chunk to claim (16 bits each).  A chunk is claimed by a compare-and-swap of that word, so a
// worker holding a stale job (it read the job, then the caller finished it and started another)
// can never claim a chunk of the wrong one: the job number no longer matches.  The job's function
// and context are written before its word is published, and rewritten only once every chunk of
// the previous job has completed, so a successful claim always pairs with the right function.
#include "team.h"

#include <linux/futex.h>
#include <omp.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

constexpr int64_t MAX_CHUNKS = 0xFFFF;

inline uint64_t pack(uint64_t job, uint64_t n, uint64_t next) { return job << 32 | n << 16 | next; }
inline uint32_t job_of(uint64_t w) { return static_cast<uint32_t>(w >> 32); }
inline int64_t count_of(uint64_t w) { return static_cast<int64_t>(w >> 16 & 0xFFFF); }
inline int64_t next_of(uint64_t w) { return static_cast<int64_t>(w & 0xFFFF); }

void futex_wait(std::atomic<uint32_t>* addr, uint32_t seen) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

struct Team {
  std::atomic<uint64_t> word{0};
  std::atomic<int64_t> done{0};
  std::atomic<uint32_t> generation{0};  // futex word: bumped for every job
  std::atomic<int> sleeping{0};
  std::atomic<int> holds{0};  // team::Hold: while > 0, idle workers spin
  std::atomic<team::ChunkFn> fn{nullptr};
  std::atomic<void*> ctx{nullptr};
  std::mutex caller;  // one job at a time; a second caller (another thread, a nested kernel) runs inline
  uint32_t job = 0;
  int64_t spin_us = 1000;
  int worker_nice = 0;
  std::vector<std::thread> workers;

  // Claim and run chunks of the job `w` names until none is left; returns how many this thread ran.
  int64_t work(uint64_t w, team::ChunkFn f, void* c) {
    const uint32_t j = job_of(w);
    int64_t ran = 0;
    while (job_of(w) == j && next_of(w) < count_of(w)) {  // a failed claim reloads w: another job ends the loop
      if (word.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        f(c, next_of(w));
        ++ran;
        done.fetch_add(1, std::memory_order_release);
        w = word.load(std::memory_order_acquire);
      }
    }
    return ran;
  }

  void worker_loop() {
    // A positive nice makes a core's other work (the Detokenizer, the HTTP front end waking for a
    // token) preempt this worker rather than the caller: a worker's lost time costs only the chunks
    // the caller then takes, the caller's stalls the whole step.
    if (worker_nice != 0) setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), worker_nice);
    uint32_t seen_job = job_of(word.load(std::memory_order_acquire));
    for (;;) {
      uint32_t gen = generation.load(std::memory_order_acquire);
      uint64_t w = word.load(std::memory_order_acquire);
      if (job_of(w) != seen_job) {
        seen_job = job_of(w);
        // valid for job `seen_job` whenever a claim of it succeeds (see above)
        work(w, fn.load(std::memory_order_relaxed), ctx.load(std::memory_order_relaxed));
        continue;
      }
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
      bool woke = false;
      for (int round = 1; holds.load(std::memory_order_relaxed) > 0 || std::chrono::steady_clock::now() < until;
           ++round) {
        if (round % 16 == 0) sched_yield();  // a thread of another process waiting for this core runs first
        for (int i = 0; i < 64; ++i) {
          cpu_relax();
          if (job_of(word.load(std::memory_order_acquire)) != seen_job) {
            woke = true;
            break;
          }
        }
        if (woke) break;
      }
      if (woke) continue;
      sleeping.fetch_add(1, std::memory_order_seq_cst);
      if (generation.load(std::memory_order_seq_cst) == gen) futex_wait(&generation, gen);
      sleeping.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  void start(int threads) {
    for (int i = 1; i < threads; ++i) workers.emplace_back([this] { worker_loop(); });
    for (auto& t : workers) t.detach();  // they live as long as the process
  }

  void run(int64_t chunks, team::ChunkFn f, void* c) {
    fn.store(f, std::memory_order_relaxed);
    ctx.store(c, std::memory_order_relaxed);
    done.store(0, std::memory_order_relaxed);
    job += 1;
    word.store(pack(job, static_cast<uint64_t>(chunks), 0), std::memory_order_release);
    generation.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping.load(std::memory_order_seq_cst) > 0) futex_wake_all(&generation);
    work(word.load(std::memory_order_acquire), f, c);
    while (done.load(std::memory_order_acquire) < chunks) cpu_relax();  // chunks a worker still runs
  }
};

Team* the_team(int threads = 0, int64_t spin_us = -1, int worker_nice = 0) {
  static Team* team = [&] {
    auto* t = new Team;  // never freed: detached workers use it until the process exits
    if (spin_us >= 0) t->spin_us = spin_us;
    t->worker_nice = worker_nice;
    t->start(threads > 0 ? threads : omp_get_max_threads());
    return t;
  }();
  return team;
}

}  // namespace

namespace team {

void run(int64_t chunks, ChunkFn fn, void* ctx) {
  if (chunks <= 0) return;
  Team* t = the_team();
  std::unique_lock<std::mutex> lock(t->caller, std::try_to_lock);
  if (chunks == 1 || !lock.owns_lock() || t->workers.empty()) {
    for (int64_t i = 0; i < chunks; ++i) fn(ctx, i);
    return;
  }
  for (int64_t first = 0; first < chunks; first += MAX_CHUNKS) {  // the word holds 16-bit counts
    const int64_t n = chunks - first < MAX_CHUNKS ? chunks - first : MAX_CHUNKS;
    struct Offset {
      ChunkFn fn;
      void* ctx;
      int64_t first;
    } off{fn, ctx, first};
    t->run(n, [](void* c, int64_t i) {
      auto* o = static_cast<Offset*>(c);
      o->fn(o->ctx, o->first + i);
    }, &off);
  }
}

int size() { return static_cast<int>(the_team()->workers.size()) + 1; }

Hold::Hold() {
  Team* t = the_team();
  t->holds.fetch_add(1, std::memory_order_seq_cst);
  t->generation.fetch_add(1, std::memory_order_seq_cst);  // a worker about to sleep sees it and spins instead
  if (t->sleeping.load(std::memory_order_seq_cst) > 0) futex_wake_all(&t->generation);
}

Hold::~Hold() { the_team()->holds.fetch_sub(1, std::memory_order_seq_cst); }

}  // namespace team

extern "C" {

// Start the team with `threads` threads in all (the caller included), workers that spin
// `spin_us` microseconds before sleeping and run at nice `worker_nice` (the caller's thread keeps
// its own).  Only the first call (or first kernel) has an effect; without a call the team has
// omp_get_max_threads() threads (torch's), spins 1000 µs and keeps the process's nice.
int kernels_team_start(int threads, int64_t spin_us, int worker_nice) {
  return static_cast<int>(the_team(threads, spin_us, worker_nice)->workers.size()) + 1;
}

// For the tests: chunk i adds one to counts[i] (each must end at exactly one), records in
// threads[i] an id of the thread that ran it, and spins `spin_ns` nanoseconds.
void kernels_team_check(int64_t chunks, int32_t* counts, int32_t* threads, int64_t spin_ns) {
  static std::atomic<int32_t> next_id{1};
  team::parallel_for(chunks, [&](int64_t i) {
    static thread_local int32_t id = -1;
    if (id < 0) id = next_id.fetch_add(1);
    __atomic_fetch_add(counts + i, 1, __ATOMIC_RELAXED);
    threads[i] = id;
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns);
    while (std::chrono::steady_clock::now() < until) cpu_relax();
  });
}

}  // extern "C"
