// Host timing of the execute handler, switched on and off through sdpagraph_host_timing.
#ifndef SDPAGRAPH_FFI_CSRC_HOST_TIMING_H_
#define SDPAGRAPH_FFI_CSRC_HOST_TIMING_H_

#include <atomic>
#include <chrono>
#include <cstdint>

namespace sdpagraph {

// Where the handler's host time goes, for bench/attention.py: the whole handler, and the part of it
// inside the frontend's execute (cuDNN's own per-call work, kernel launch included). Counted only
// while enabled, so an untimed call pays one relaxed load. Meant for a quiet moment between calls:
// a call still running when the totals are taken is counted in the next window.
class HostTiming {
 public:
  struct Totals {
    bool was_enabled = false;  // whether timing was on during the window these totals cover
    int64_t calls = 0;
    int64_t handler_ns = 0;
    int64_t cudnn_execute_ns = 0;
  };

  static int64_t NowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  void Add(int64_t handler_ns, int64_t cudnn_execute_ns) {
    calls_.fetch_add(1, std::memory_order_relaxed);
    handler_ns_.fetch_add(handler_ns, std::memory_order_relaxed);
    cudnn_execute_ns_.fetch_add(cudnn_execute_ns, std::memory_order_relaxed);
  }

  // Returns the totals so far, resets them, and turns counting on or off.
  Totals Take(bool enable) {
    Totals totals;
    totals.was_enabled = enabled_.exchange(enable, std::memory_order_relaxed);
    totals.calls = calls_.exchange(0, std::memory_order_relaxed);
    totals.handler_ns = handler_ns_.exchange(0, std::memory_order_relaxed);
    totals.cudnn_execute_ns = cudnn_execute_ns_.exchange(0, std::memory_order_relaxed);
    return totals;
  }

 private:
  std::atomic<bool> enabled_{false};
  std::atomic<int64_t> calls_{0};
  std::atomic<int64_t> handler_ns_{0};
  std::atomic<int64_t> cudnn_execute_ns_{0};
};

}  // namespace sdpagraph

#endif  // SDPAGRAPH_FFI_CSRC_HOST_TIMING_H_
