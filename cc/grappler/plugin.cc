// The Grappler plugin: registers the passes through TensorFlow's pluggable graph optimizer C API
// (tensorflow/c/experimental/grappler/grappler.h), so that every graph TensorFlow optimizes
// (tf.function, Keras train/predict functions) gets the fusion pass (fuse_relu_max_pool.cc)
// while tf_relupool's recompute switch is on and the layout pass (fold_transposes.cc) always;
// and the C API tf_relupool/grappler.py and tf_relupool.rewrite_graph call through ctypes (the
// switch's mode, counters, texts, the pass over a serialized GraphDef). cc/grappler/README.md
// has the facts this relies on.
//
// Failure policy: the pass never fails the user's function. Anything unexpected (a parse error,
// an exception) returns TF_ABORTED, which MetaOptimizer::RunOptimizer treats as "did nothing"
// and keeps the graph it passed in; the first such error is logged once (LOG(WARNING)) and all
// are counted (tf_relupool_grappler_stats).

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "cc/grappler/fold_transposes.h"
#include "cc/grappler/fuse_relu_max_pool.h"
#include "cc/grappler/graph_util.h"
#include "cc/grappler/patterns.h"
#include "cc/grappler/state.h"
#include "google/protobuf/arena.h"
#include "tensorflow/c/experimental/grappler/grappler.h"
#include "tensorflow/core/grappler/optimizers/custom_graph_optimizer_registry.h"
#include "tensorflow/core/platform/logging.h"

namespace tf_relupool {
namespace grappler {
namespace {

void DeallocateBuffer(void* data, size_t) { free(data); }

void Optimize(void*, const TF_Buffer* graph_buf, const TF_GrapplerItem* item,
              TF_Buffer* optimized_buf, TF_Status* status) {
  const auto start = std::chrono::steady_clock::now();
  g_stats[kCalls]++;
  TF_SetStatus(status, TF_ABORTED, "tf_relupool: nothing to fuse");
  const int mode = g_mode.load();
  if (mode == kOff) g_stats[kCallsOff]++;
  try {
    const int fault = g_fault.load();
    if (fault == 1) throw std::runtime_error("injected fault");
    if (fault == 2) {
      TF_SetStatus(status, TF_INTERNAL, "tf_relupool: injected TF_INTERNAL");
      return;
    }
    if (fault == 3) {
      static const char kJunk[] = "\xff\xff\xff\xff not a GraphDef";
      void* data = malloc(sizeof(kJunk));
      memcpy(data, kJunk, sizeof(kJunk));
      optimized_buf->data = data;
      optimized_buf->length = sizeof(kJunk);
      optimized_buf->data_deallocator = DeallocateBuffer;
      TF_SetStatus(status, TF_OK, "");
      return;
    }
    // Cheap pre-checks on the serialized bytes: stock pools to fuse (switch on), or fused ops
    // whose layout may need the NCHW form (whatever the switch: it changes no value).
    const bool stock_pools =
        mode != kOff && memmem(graph_buf->data, graph_buf->length, "MaxPool", 7) != nullptr;
    const bool fused_ops = memmem(graph_buf->data, graph_buf->length, "ReluMaxPool", 11) != nullptr;
    if (stock_pools || fused_ops) g_stats[kBytesIn] += graph_buf->length;
    if (stock_pools || fused_ops) {
      // An arena: parsing and freeing ~10^4 small messages costs several times less.
      google::protobuf::Arena arena;
      GraphDef& graph = *google::protobuf::Arena::Create<GraphDef>(&arena);
      const auto parse_start = std::chrono::steady_clock::now();
      const bool parsed =
          graph.ParseFromArray(graph_buf->data, static_cast<int>(graph_buf->length));
      g_stats[kParseNanos] += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - parse_start).count();
      if (!parsed) {
        RecordError("could not parse the GraphDef TensorFlow passed in");
      } else {
        std::unordered_set<std::string> preserve;
        const bool have_preserve = NodesToPreserve(item, &preserve);
        if (!have_preserve) RecordError("TF_GetNodesToPreserveList is not available");
        int64_t stats[kNumStats] = {};
        int64_t removed_transposes = 0;
        int fused = 0, nchw = 0;
        if (have_preserve) {
          if (stock_pools) fused = FuseReluMaxPool(&graph, mode, &preserve, "", nullptr, stats);
          nchw = FoldTransposes(&graph, &preserve, nullptr, &removed_transposes);
        }
        g_stats[kNotFused] += stats[kNotFused];
        fused += nchw;
        if (fused > 0 && fault == 4) graph.mutable_node(0)->add_input("tf_relupool_no_such_node");
        const std::string dangling = fused > 0 && fault != 4 ? DanglingInput(graph) : "";
        if (!dangling.empty()) {
          RecordError("internal error, rewritten graph has a dangling input: " + dangling);
          fused = 0;
        }
        if (fused > 0) {
          const size_t size = graph.ByteSizeLong();
          void* data = malloc(size);
          if (data == nullptr || !graph.SerializeToArray(data, static_cast<int>(size))) {
            free(data);
            RecordError("could not serialize the rewritten GraphDef");
          } else {
            optimized_buf->data = data;
            optimized_buf->length = size;
            optimized_buf->data_deallocator = DeallocateBuffer;
            g_stats[kGraphsRewritten]++;
            for (Stat k : {kFusedWithGrad, kFusedForwardOnly, kFusedConvRelu, kFusedThroughPad,
                           kFusedMaxPoolV2})
              g_stats[k] += stats[k];
            g_stats[kNchwOps] += nchw;
            g_stats[kTransposesRemoved] += removed_transposes;
            TF_SetStatus(status, TF_OK, "");
          }
        }
      }
    }
  } catch (const std::exception& e) {
    RecordError(std::string("exception: ") + e.what());
    TF_SetStatus(status, TF_ABORTED, "tf_relupool: error, graph unchanged");
  } catch (...) {
    RecordError("unknown exception");
    TF_SetStatus(status, TF_ABORTED, "tf_relupool: error, graph unchanged");
  }
  g_stats[kNanos] += std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now() - start).count();
}

// The pass over a serialized GraphDef outside Grappler (tf_relupool.rewrite_graph): nodes with
// no device are taken as CPU nodes, `preserve` names nodes to leave alone. Returns the number
// of changes (fusions, and fused ops switched to NCHW between transposes) and the rewritten
// graph in *out (only when > 0), or -1 and the error in *log.
int RewriteOffline(const void* data, size_t size, int mode, const char* preserve_lines,
                   std::string* out, std::string* log) {
  if (mode != kArgmax && mode != kInput) {
    *log = "mode must be 1 (argmax) or 2 (input)";
    return -1;
  }
  google::protobuf::Arena arena;
  GraphDef& graph = *google::protobuf::Arena::Create<GraphDef>(&arena);
  if (size > static_cast<size_t>(INT32_MAX) ||
      !graph.ParseFromArray(data, static_cast<int>(size))) {
    *log = "could not parse the GraphDef";
    return -1;
  }
  std::unordered_set<std::string> preserve;
  if (preserve_lines != nullptr) {
    std::string name;
    for (const char* c = preserve_lines;; ++c) {
      if (*c == '\n' || *c == '\0') {
        if (!name.empty()) preserve.insert(name);
        name.clear();
        if (*c == '\0') break;
      } else {
        name += *c;
      }
    }
  }
  std::vector<std::string> lines;
  int64_t stats[kNumStats] = {};
  int64_t removed_transposes = 0;
  int fused = FuseReluMaxPool(&graph, mode, &preserve, "CPU", &lines, stats);
  fused += FoldTransposes(&graph, &preserve, &lines, &removed_transposes);
  for (const auto& l : lines) *log += l + "\n";
  if (fused > 0) {
    const std::string dangling = DanglingInput(graph);
    if (!dangling.empty()) {
      *log += "internal error, rewritten graph has a dangling input: " + dangling;
      return -1;
    }
    if (!graph.SerializeToString(out)) {
      *log += "could not serialize the rewritten GraphDef";
      return -1;
    }
  }
  return fused;
}

char* MallocCopy(const std::string& s) {
  char* p = static_cast<char*>(malloc(s.size() + 1));
  if (p != nullptr) memcpy(p, s.data(), s.size() + 1);
  return p;
}

}  // namespace
}  // namespace grappler
}  // namespace tf_relupool

using namespace tf_relupool::grappler;  // NOLINT: the C entry points below

extern "C" {

// Called by TensorFlow (TF_LoadPluggableDeviceLibrary -> RegisterPluggableDevicePlugin ->
// InitGraphPlugin) each time it loads this library under a new file name. TensorFlow keeps one
// plugin optimizer per device type and aborts the process (LOG(FATAL)) on a second registration
// for the same type, and it also aborts (TF_CHECK_OK) when this function reports an error; so it
// never reports one: a device type already taken (by us or by another plugin) is replaced by a
// placeholder type that matches no device.
__attribute__((visibility("default"))) void TF_InitGraph(TP_OptimizerRegistrationParams* params,
                                                         TF_Status* status) {
  std::string wanted;
  {
    std::lock_guard<std::mutex> lock(g_text_mu);
    wanted = g_next_device_type;
  }
  const bool taken = !tensorflow::grappler::PluginGraphOptimizerRegistry::CreateOptimizers(
                          std::set<std::string>{wanted}).empty();
  std::string type = wanted;
  if (taken) {
    type = "TF_RELUPOOL_UNUSED_" + wanted;
    for (int i = 1; !tensorflow::grappler::PluginGraphOptimizerRegistry::CreateOptimizers(
                         std::set<std::string>{type}).empty(); ++i)
      type = "TF_RELUPOOL_UNUSED_" + wanted + "_" + std::to_string(i);
    LOG(WARNING) << "tf_relupool grappler: a graph optimizer for device type " << wanted
                 << " is already registered; not registering another";
  }
  const char* stable;
  {
    std::lock_guard<std::mutex> lock(g_text_mu);
    g_device_type_storage.push_back(type);
    stable = g_device_type_storage.back().c_str();
    if (!taken) g_registered += (g_registered.empty() ? "" : ",") + type;
  }
  params->struct_size = TP_OPTIMIZER_REGISTRATION_PARAMS_STRUCT_SIZE;
  params->device_type = stable;
  // All configs stay TF_TriState_Default: InitGraphPlugin maps Default to ON, and TF's own
  // optimizers are turned off only by an explicit Off (custom_graph_optimizer_registry.cc,
  // GetPluginConfigs), which would apply to every graph holding a node of this device type.
  params->optimizer_configs->struct_size = TP_OPTIMIZER_CONFIGS_STRUCT_SIZE;
  params->optimizer->struct_size = TP_OPTIMIZER_STRUCT_SIZE;
  params->optimizer->create_func = nullptr;
  params->optimizer->optimize_func = Optimize;
  params->optimizer->destroy_func = nullptr;
  TF_SetStatus(status, TF_OK, "");
}

// Sets the device type the next TF_InitGraph call registers ("CPU", "GPU").
__attribute__((visibility("default"))) void tf_relupool_grappler_set_next_device_type(
    const char* type) {
  std::lock_guard<std::mutex> lock(g_text_mu);
  g_next_device_type = type;
}

// Writes the device types registered so far ("CPU,GPU") into buf; returns the full length.
__attribute__((visibility("default"))) int tf_relupool_grappler_registered(char* buf, int size) {
  std::lock_guard<std::mutex> lock(g_text_mu);
  if (size > 0) snprintf(buf, size, "%s", g_registered.c_str());
  return static_cast<int>(g_registered.size());
}

// 0: off, 1: keep argmax codes, 2: keep the input. Read by every pass.
__attribute__((visibility("default"))) void tf_relupool_grappler_set_mode(int mode) {
  g_mode.store(mode == kArgmax || mode == kInput ? mode : kOff);
}

__attribute__((visibility("default"))) int tf_relupool_grappler_mode() { return g_mode.load(); }

__attribute__((visibility("default"))) void tf_relupool_grappler_inject_fault(int fault) {
  g_fault.store(fault);
}

__attribute__((visibility("default"))) void tf_relupool_grappler_set_verbose(int verbose) {
  g_verbose.store(verbose != 0);
}

// Copies up to n counters (see enum Stat) into out; returns how many exist.
__attribute__((visibility("default"))) int tf_relupool_grappler_stats(int64_t* out, int n) {
  for (int i = 0; i < n && i < kNumStats; ++i) out[i] = g_stats[i].load();
  return kNumStats;
}

__attribute__((visibility("default"))) void tf_relupool_grappler_reset_stats() {
  for (auto& s : g_stats) s.store(0);
  std::lock_guard<std::mutex> lock(g_text_mu);
  g_last_error.clear();
  g_last_skip.clear();
}

// which: 0 last error, 1 last candidate not fused. Returns the full length.
__attribute__((visibility("default"))) int tf_relupool_grappler_text(int which, char* buf,
                                                                     int size) {
  std::lock_guard<std::mutex> lock(g_text_mu);
  const std::string& s = which == 0 ? g_last_error : g_last_skip;
  if (size > 0) snprintf(buf, size, "%s", s.c_str());
  return static_cast<int>(s.size());
}

// The pattern table of patterns.h as text (PatternTable()); returns the full length.
__attribute__((visibility("default"))) int tf_relupool_grappler_patterns(char* buf, int size) {
  static const std::string table = PatternTable();
  if (size > 0) snprintf(buf, size, "%s", table.c_str());
  return static_cast<int>(table.size());
}

// The pass over a serialized GraphDef, outside Grappler: what tf_relupool.rewrite_graph runs.
// mode 1 keeps argmax codes, 2 the input; preserve: '\n'-separated node names to leave alone
// (may be null). Returns the number of changes (fusions, NCHW switches), or -1 on an error.
// *out (the rewritten GraphDef, only when changes > 0; else null) and *log (one line per fusion or refusal, or the error) are
// malloc'd: free them with tf_relupool_free. Exceptions do not cross this boundary.
__attribute__((visibility("default"))) int tf_relupool_rewrite_graph(
    const void* graph, size_t size, int mode, const char* preserve, char** out, size_t* out_size,
    char** log) {
  *out = nullptr;
  *out_size = 0;
  std::string result, text;
  int fused;
  try {
    fused = RewriteOffline(graph, size, mode, preserve, &result, &text);
  } catch (const std::exception& e) {
    text += std::string("exception: ") + e.what();
    fused = -1;
  } catch (...) {
    text += "unknown exception";
    fused = -1;
  }
  *log = MallocCopy(text);
  if (fused > 0) {
    *out = MallocCopy(result);
    *out_size = result.size();
    if (*out == nullptr) fused = -1;
  }
  return fused;
}

__attribute__((visibility("default"))) void tf_relupool_free(void* p) { free(p); }

}  // extern "C"
