// Definitions of the state in state.h (shared by the passes and the C API of plugin.cc).
#include "cc/grappler/state.h"

#include "tensorflow/core/platform/logging.h"

namespace tf_relupool {
namespace grappler {

std::atomic<int> g_mode{kOff};
std::atomic<int64_t> g_stats[kNumStats];
std::mutex g_text_mu;
std::string g_last_error;
std::string g_last_skip;
std::string g_registered;
std::string g_next_device_type = "CPU";
std::deque<std::string> g_device_type_storage;
std::atomic<bool> g_verbose{false};
std::atomic<int> g_fault{0};

void SetText(std::string* dst, const std::string& value) {
  std::lock_guard<std::mutex> lock(g_text_mu);
  *dst = value;
}

void RecordError(const std::string& what) {
  g_stats[kErrors]++;
  static std::once_flag once;
  std::call_once(once, [&] {
    LOG(WARNING) << "tf_relupool grappler: " << what
                 << "; graphs are left unchanged when this happens (logged once).";
  });
  SetText(&g_last_error, what);
}

}  // namespace grappler
}  // namespace tf_relupool
