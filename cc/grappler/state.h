// The state the Grappler pass shares with Python: the switch's mode, the counters, the last error
// and refusal texts, the registration bookkeeping and the fault-injection test hook. Written by
// the extern "C" functions of plugin.cc (what tf_relupool/grappler.py calls through ctypes) and
// read by every pass; plain atomics and one mutex for the texts.
#ifndef TF_RELUPOOL_CC_GRAPPLER_STATE_H_
#define TF_RELUPOOL_CC_GRAPPLER_STATE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>

namespace tf_relupool {
namespace grappler {

enum Mode : int { kOff = 0, kArgmax = 1, kInput = 2 };
extern std::atomic<int> g_mode;

enum Stat : int {
  kCalls = 0,          // optimize_func invocations
  kCallsOff,           // ... of which with the switch off (only the layout part runs)
  kGraphsRewritten,    // graphs returned with at least one fusion
  kFusedWithGrad,      // forward + gradient fusions
  kFusedForwardOnly,   // forward-only fusions
  kFusedConvRelu,      // of the above, on a remapper _FusedConv2D(BiasAdd, Relu)
  kNotFused,           // ReLU + MaxPool candidates left in place (see last_skip)
  kErrors,             // unexpected errors (graph returned unchanged)
  kNanos,              // time spent inside optimize_func (ns)
  kBytesIn,            // serialized GraphDef bytes received
  kParseNanos,         // of kNanos, parsing the GraphDef
  kFusedThroughPad,    // of the fusions, Relu -> Pad -> MaxPool (the Pad moved before the ReLU)
  kFusedMaxPoolV2,     // of the fusions, on a MaxPoolV2 (window from constant inputs)
  kNchwOps,            // fused ops switched to NCHW between the layout optimizer's transposes
  kTransposesRemoved,  // Transposes removed by those switches
  kNumStats
};
extern std::atomic<int64_t> g_stats[kNumStats];

extern std::mutex g_text_mu;
extern std::string g_last_error;  // guarded by g_text_mu
extern std::string g_last_skip;   // guarded by g_text_mu: why the last candidate was not fused
extern std::string g_registered;  // guarded by g_text_mu: "CPU,GPU" as registered
extern std::string g_next_device_type;              // guarded by g_text_mu
extern std::deque<std::string> g_device_type_storage;  // stable char* for TF (it keeps it)
extern std::atomic<bool> g_verbose;
// Test hook (tf_relupool_grappler_inject_fault): 1 throw inside the pass, 2 return TF_INTERNAL,
// 3 return bytes that are no GraphDef, 4 return a GraphDef with a dangling input (bypassing the
// pass's own check). Used to show what TensorFlow does with each.
extern std::atomic<int> g_fault;

// *dst = value under g_text_mu.
void SetText(std::string* dst, const std::string& value);

// Counts an unexpected error, logs the first one (LOG(WARNING)) and keeps its text.
void RecordError(const std::string& what);

}  // namespace grappler
}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_GRAPPLER_STATE_H_
