// ThreadPool: every index runs exactly once, concurrent and nested loops finish, and the pool is
// reused rather than threads started per call.
#include "kvserve/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

namespace kvserve {
namespace {

TEST(ThreadPool, RunsEveryIndexOnceInContiguousParts) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (uint64_t n : {0ull, 1ull, 2ull, 7ull, 1000ull}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, [&](uint64_t i) { hits[i]++; });
      for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << n << " " << i;
    }
  }
  EXPECT_EQ(ThreadPool(0).size(), 1);
  EXPECT_EQ(ThreadPool(-3).size(), 1);
}

TEST(ThreadPool, UsesItsOwnWorkersAndNoOthers) {
  ThreadPool pool(3);
  std::mutex mu;
  std::set<std::thread::id> seen;
  for (int round = 0; round < 20; ++round) {
    pool.ParallelFor(64, [&](uint64_t) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      std::lock_guard<std::mutex> l(mu);
      seen.insert(std::this_thread::get_id());
    });
  }
  // The caller and at most two workers, the same ones every round.
  EXPECT_LE(seen.size(), 3u);
  EXPECT_GE(seen.size(), 2u);
}

TEST(ThreadPool, ConcurrentAndNestedLoopsFinish) {
  ThreadPool pool(2);
  std::atomic<uint64_t> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 50; ++r) {
        pool.ParallelFor(8, [&](uint64_t i) {
          pool.ParallelFor(4, [&](uint64_t j) { sum += i * 4 + j; });  // nested on the same pool
        });
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(sum.load(), 4u * 50u * (31u * 32u / 2u));
}

TEST(ThreadPool, MaxPartsLimitsTheSplit) {
  ThreadPool pool(4);
  std::mutex mu;
  std::set<std::thread::id> seen;
  pool.ParallelFor(100, [&](uint64_t) {
    std::lock_guard<std::mutex> l(mu);
    seen.insert(std::this_thread::get_id());
  }, 1);
  EXPECT_EQ(seen.size(), 1u);
}

}  // namespace
}  // namespace kvserve
