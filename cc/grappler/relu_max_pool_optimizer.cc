// A Grappler graph optimizer, registered through TensorFlow's pluggable graph optimizer C API
// (tensorflow/c/experimental/grappler/grappler.h), that fuses stock ReLU + max pooling in every
// graph TensorFlow optimizes (tf.function, Keras train/predict functions) while tf_relupool's
// recompute switch is on. cc/grappler/README.md has the facts this relies on.
//
// Patterns, matched on the graph TensorFlow hands to plugin optimizers (after its own passes,
// remapper and layout optimizer included):
//
//   forward only:   MaxPool(Relu(z))                    -> ReluMaxPool(z)
//   with gradient:  MaxPool(Relu(z)),
//                   ReluGrad(MaxPoolGrad(Relu(z), MaxPool, dy), Relu(z))
//                   keep "argmax" -> ReluMaxPoolWithWindowArgmax(z),
//                                    ReluMaxPoolGradFromWindowArgmax(Shape(z), dy, argmax)
//                   keep "input"  -> ReluMaxPool(z), ReluMaxPoolGrad(z, dy)
//   remapper's fused convolution (Keras Conv2D(activation="relu") after TF's remapper):
//                   _FusedConv2D(fused_ops=[..., Relu]) in place of Relu(z), with gradient: the
//                   convolution is left as it is and its (ReLU'd) output is the fused op's
//                   input; relu(a) == a bit for bit, so stock's bits on every device
//   forward only, after TF's arithmetic optimizer swapped them:
//                   Relu(MaxPool(z))                    -> ReluMaxPool(z)
//   MaxPoolV2 / MaxPoolGradV2 (window as constant inputs) wherever MaxPool / MaxPoolGrad is.
//   a constant Pad between the ReLU and the pool (keras.applications ResNet/DenseNet stems,
//   ZeroPadding2D then MaxPooling2D): relu(pad(z)) == pad(relu(z)) element by element for a
//   pad value c with relu(c) == c (Pad: +0; PadV2: c >= +0), so
//                   MaxPool(Pad(Relu(z)))               -> Fused(Pad(z))
//                   ReluGrad(Slice(MaxPoolGrad(Pad, MaxPool, dy)), Relu(z))
//                                                       -> Slice(FusedGrad(Pad(z), dy))
//     the Slice being the Pad's gradient (begin = the Pad's leading paddings). Exact for the
//     gradient too: ReluGrad is element-wise and Slice(relu(Pad(z))) == relu(z).
//
// The Relu's output must have no consumers other than these (and shape-only ops: Shape, ShapeN,
// Rank, Size, rewired to z); the fused forward takes the MaxPool's name and the fused gradient
// the ReluGrad's name (with a Pad: the MaxPoolGrad's, and the Slice takes the ReluGrad's), so
// their consumers need no change; control edges on removed nodes move to the node replacing
// them. Nothing is rewritten unless a kernel of the fused op exists for the node's device
// (KernelDefAvailable).
//
// The same Rewriter runs outside Grappler on a serialized GraphDef (tf_relupool_rewrite_graph,
// at the end): tf_relupool.rewrite_graph calls it through ctypes, so the explicit Python API and
// the switch share one implementation of the patterns.
//
// Failure policy: the pass never fails the user's function. Anything unexpected (a parse error,
// an exception) returns TF_ABORTED, which MetaOptimizer::RunOptimizer treats as "did nothing"
// and keeps the graph it passed in; the first such error is logged once (LOG(WARNING)) and all
// are counted (tf_relupool_grappler_stats).

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <initializer_list>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cc/kernels/relu_max_pool.h"  // CheckExplicitPaddings
#include "tensorflow/c/experimental/grappler/grappler.h"
#include "google/protobuf/arena.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/graph.pb.h"
#include "tensorflow/core/framework/node_def.pb.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/grappler/optimizers/custom_graph_optimizer_registry.h"
#include "tensorflow/core/platform/logging.h"

namespace tf_relupool {
namespace grappler {
namespace {

using tensorflow::AttrValue;
using tensorflow::GraphDef;
using tensorflow::NodeDef;

// ---- State shared with Python (through the extern "C" functions at the end) ----

enum Mode : int { kOff = 0, kArgmax = 1, kInput = 2 };
std::atomic<int> g_mode{kOff};

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
std::atomic<int64_t> g_stats[kNumStats];

std::mutex g_text_mu;
std::string g_last_error;  // guarded by g_text_mu
std::string g_last_skip;   // guarded by g_text_mu: why the last candidate was not fused
std::string g_registered;  // guarded by g_text_mu: "CPU,GPU" as registered
std::string g_next_device_type = "CPU";  // guarded by g_text_mu
std::deque<std::string> g_device_type_storage;  // stable char* for TF (it keeps the pointer)
std::atomic<bool> g_verbose{false};
// Test hook (tf_relupool_grappler_inject_fault): 1 throw inside the pass, 2 return TF_INTERNAL,
// 3 return bytes that are no GraphDef, 4 return a GraphDef with a dangling input (bypassing the
// pass's own check). Used to show what TensorFlow does with each.
std::atomic<int> g_fault{0};

void SetText(std::string* dst, const std::string& value) {
  std::lock_guard<std::mutex> lock(g_text_mu);
  *dst = value;
}

// ---- GraphDef helpers ----

struct Input {
  std::string node;
  int index;  // -1: control input
};

Input ParseInput(const std::string& s) {
  if (!s.empty() && s[0] == '^') return {s.substr(1), -1};
  const size_t colon = s.rfind(':');
  if (colon != std::string::npos && colon + 1 < s.size()) {
    bool digits = true;
    for (size_t i = colon + 1; i < s.size(); ++i) digits = digits && isdigit(s[i]);
    if (digits) return {s.substr(0, colon), atoi(s.c_str() + colon + 1)};
  }
  return {s, 0};
}

bool IsControl(const std::string& s) { return !s.empty() && s[0] == '^'; }

// The node an input names ("^a", "a", "a:2" -> "a"), without copying: for the loops over every
// input of the graph.
std::string_view InputNode(std::string_view s) {
  if (!s.empty() && s[0] == '^') return s.substr(1);
  const size_t colon = s.rfind(':');
  if (colon == std::string_view::npos || colon + 1 == s.size()) return s;
  for (size_t i = colon + 1; i < s.size(); ++i)
    if (!isdigit(static_cast<unsigned char>(s[i]))) return s;
  return s.substr(0, colon);
}

std::vector<std::string> DataInputs(const NodeDef& n) {
  std::vector<std::string> v;
  for (const auto& i : n.input())
    if (!IsControl(i)) v.push_back(i);
  return v;
}

std::vector<std::string> ControlInputs(const NodeDef& n) {
  std::vector<std::string> v;
  for (const auto& i : n.input())
    if (IsControl(i)) v.push_back(i);
  return v;
}

const AttrValue* Attr(const NodeDef& n, const char* name) {
  auto it = n.attr().find(name);
  return it == n.attr().end() ? nullptr : &it->second;
}

tensorflow::DataType TypeAttr(const NodeDef& n, const char* name) {
  const AttrValue* a = Attr(n, name);
  return a == nullptr ? tensorflow::DT_INVALID : a->type();
}

std::string StringAttr(const NodeDef& n, const char* name, const std::string& dflt) {
  const AttrValue* a = Attr(n, name);
  return a == nullptr ? dflt : a->s();
}

// "/job:localhost/replica:0/task:0/device:GPU:0" -> "GPU"; "" when unknown.
std::string DeviceType(const std::string& device) {
  const size_t at = device.rfind("device:");
  if (at == std::string::npos) return "";
  const size_t start = at + 7;
  const size_t colon = device.find(':', start);
  return device.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
}

// Nodes TensorFlow says must survive (fetch, feed, keep ops). The functions live in
// libtensorflow_cc.so.2, which every TensorFlow Python process has loaded; they are looked up at
// run time so that this file links against libtensorflow_framework.so.2 alone (like the op
// library it is part of). Returns false when they cannot be found.
using PreserveSizeFn = void (*)(const TF_GrapplerItem*, int*, size_t*, TF_Status*);
using PreserveListFn = void (*)(const TF_GrapplerItem*, char**, size_t*, int, void*, size_t,
                                TF_Status*);

void* FindTfSymbol(const char* name) {
  void* sym = dlsym(RTLD_DEFAULT, name);
  if (sym != nullptr) return sym;
  static void* cc = dlopen("libtensorflow_cc.so.2", RTLD_LAZY | RTLD_NOLOAD);
  return cc == nullptr ? nullptr : dlsym(cc, name);
}

bool NodesToPreserve(const TF_GrapplerItem* item, std::unordered_set<std::string>* out) {
  static PreserveSizeFn size_fn =
      reinterpret_cast<PreserveSizeFn>(FindTfSymbol("TF_GetNodesToPreserveListSize"));
  static PreserveListFn list_fn =
      reinterpret_cast<PreserveListFn>(FindTfSymbol("TF_GetNodesToPreserveList"));
  if (size_fn == nullptr || list_fn == nullptr || item == nullptr) return false;
  TF_Status* status = TF_NewStatus();
  int num = 0;
  size_t storage_size = 0;
  size_fn(item, &num, &storage_size, status);
  bool ok = TF_GetCode(status) == TF_OK;
  if (ok && num > 0) {
    std::vector<char*> values(num);
    std::vector<size_t> lengths(num);
    std::vector<char> storage(storage_size + 1);
    list_fn(item, values.data(), lengths.data(), num, storage.data(), storage.size(), status);
    ok = TF_GetCode(status) == TF_OK;
    for (int i = 0; ok && i < num; ++i) out->emplace(values[i], lengths[i]);
  }
  TF_DeleteStatus(status);
  return ok;
}

// ---- The rewrite ----

bool SupportedType(tensorflow::DataType t) {
  return t == tensorflow::DT_HALF || t == tensorflow::DT_BFLOAT16 || t == tensorflow::DT_FLOAT ||
         t == tensorflow::DT_DOUBLE;
}

bool IsMaxPool(const NodeDef& n) { return n.op() == "MaxPool" || n.op() == "MaxPoolV2"; }
bool IsMaxPoolGrad(const NodeDef& n) {
  return n.op() == "MaxPoolGrad" || n.op() == "MaxPoolGradV2";
}
bool IsPad(const NodeDef& n) { return n.op() == "Pad" || n.op() == "PadV2"; }
bool IsReluSource(const NodeDef& n) { return n.op() == "Relu" || n.op() == "_FusedConv2D"; }
// Ops that read only their input's shape: the same after the rewrite when fed z instead of relu(z).
bool IsShapeOnly(const NodeDef& n) {
  return n.op() == "Shape" || n.op() == "ShapeN" || n.op() == "Rank" || n.op() == "Size";
}

// The narrowest code type for windows of ksize (the window may be smaller at run time).
tensorflow::DataType ArgmaxType(const std::vector<int64_t>& ksize, bool nhwc) {
  const int64_t positions = ksize[nhwc ? 1 : 2] * ksize[nhwc ? 2 : 3];
  if (positions < 255) return tensorflow::DT_UINT8;
  if (positions < 65535) return tensorflow::DT_UINT16;
  return tensorflow::DT_INT32;
}

// Pooling window of a MaxPool/MaxPoolGrad (attrs) or MaxPoolV2/MaxPoolGradV2 (constant inputs).
struct Window {
  std::vector<int64_t> ksize, strides;
  std::vector<int64_t> explicit_paddings;  // MaxPool / MaxPoolGrad with padding EXPLICIT
  bool operator==(const Window& o) const {
    return ksize == o.ksize && strides == o.strides && explicit_paddings == o.explicit_paddings;
  }
};

// What both passes below need: the graph, its node index, the nodes to preserve, the log,
// constant inputs, and names for new nodes.
class GraphPass {
 protected:
  GraphPass(GraphDef* graph, const std::unordered_set<std::string>* preserve,
            std::vector<std::string>* log)
      : g_(graph), preserve_(preserve), log_(log) {}

  void IndexNames() {
    index_.reserve(g_->node_size());
    for (int i = 0; i < g_->node_size(); ++i) index_[g_->node(i).name()] = i;
  }
  const NodeDef& node(int i) const { return g_->node(i); }
  int Find(const std::string& name) const {
    auto it = index_.find(name);
    return it == index_.end() ? -1 : it->second;
  }
  bool Preserved(const std::string& name) const {
    return preserve_ != nullptr && preserve_->count(name);
  }
  bool Preserved(int i) const { return Preserved(node(i).name()); }

  void Log(const std::string& text) {
    if (log_ != nullptr) log_->push_back(text);
    if (g_verbose.load()) LOG(INFO) << "tf_relupool grappler: " << text;
  }

  // The tensor of a Const node feeding `input` (false if it is none).
  bool ConstInput(const std::string& input, tensorflow::Tensor* out) const {
    if (IsControl(input)) return false;
    const Input in = ParseInput(input);
    const int i = Find(in.node);
    if (i < 0 || in.index != 0 || node(i).op() != "Const") return false;
    const AttrValue* v = Attr(node(i), "value");
    return v != nullptr && out->FromProto(v->tensor());
  }

  // The integers of a 1-D int32/int64 Const feeding `input`.
  bool ConstInts(const std::string& input, std::vector<int64_t>* out) const {
    tensorflow::Tensor t;
    if (!ConstInput(input, &t) || t.dims() != 1) return false;
    out->clear();
    if (t.dtype() == tensorflow::DT_INT32) {
      for (int64_t i = 0; i < t.NumElements(); ++i) out->push_back(t.flat<int32_t>()(i));
    } else if (t.dtype() == tensorflow::DT_INT64) {
      for (int64_t i = 0; i < t.NumElements(); ++i) out->push_back(t.flat<int64_t>()(i));
    } else {
      return false;
    }
    return true;
  }

  // `base`, or `base_N`, unused by the graph and by earlier calls.
  std::string UniqueName(const std::string& base) {
    std::string name = base;
    for (int i = 1; index_.count(name) || added_names_.count(name); ++i)
      name = base + "_" + std::to_string(i);
    added_names_.insert(name);
    return name;
  }

  GraphDef* g_;
  const std::unordered_set<std::string>* preserve_;
  std::vector<std::string>* log_;
  std::unordered_map<std::string, int> index_;
  std::unordered_set<std::string> added_names_;
  std::vector<NodeDef> added_;  // new nodes, appended to the graph at the end
};

class Rewriter : public GraphPass {
 public:
  // mode: kArgmax or kInput. preserve: node names that must survive (may be null).
  // default_device_type: the device type assumed for nodes with no device ("" inside Grappler,
  // where devices are set; "CPU" for GraphDefs rewritten offline, see tf_relupool_rewrite_graph).
  // log: if not null, every fusion and refusal is appended to it as one line.
  Rewriter(GraphDef* graph, int mode, const std::unordered_set<std::string>* preserve,
           const std::string& default_device_type = "", std::vector<std::string>* log = nullptr)
      : GraphPass(graph, preserve, log), mode_(mode), default_device_type_(default_device_type) {
    IndexNames();
  }

  // Counters of this run (enum Stat indices; only the fusion/refusal ones are used).
  int64_t stats[kNumStats] = {};

  // Number of fusions applied.
  int Run() {
    // Candidates first (a MaxPool fed by a Relu, a _FusedConv2D or a Pad; a Relu fed by a
    // MaxPool): most graphs have none, and then the consumer index below is never built.
    std::vector<int> pools, relus;
    for (int i = 0; i < g_->node_size(); ++i) {
      const NodeDef& n = g_->node(i);
      const bool pool = IsMaxPool(n);
      if ((!pool && n.op() != "Relu") || n.input_size() == 0 || IsControl(n.input(0))) continue;
      const int src = Find(ParseInput(n.input(0)).node);
      if (src < 0) continue;
      if (pool && (IsReluSource(node(src)) || IsPad(node(src)))) pools.push_back(i);
      if (!pool && IsMaxPool(node(src))) relus.push_back(i);
    }
    if (pools.empty() && relus.empty()) return 0;
    IndexConsumers();
    std::vector<Plan> plans;
    std::unordered_set<int> claimed;  // MaxPool nodes taken by a plan
    for (int i : pools) {
      Plan p;
      if (Match(i, &p)) {
        plans.push_back(p);
        claimed.insert(i);
      }
    }
    for (int i : relus) {
      Plan p;
      if (MatchReluOfPool(i, claimed, &p)) {
        plans.push_back(p);
        claimed.insert(p.pool);
      }
    }
    if (plans.empty()) return 0;
    for (const Plan& p : plans) Apply(p);
    Finish();
    return static_cast<int>(plans.size());
  }

 private:
  struct Plan {
    int relu = -1;       // Relu or _FusedConv2D node index
    bool fused_conv = false;
    bool relu_of_pool = false;  // Relu(MaxPool(z)): the order TF's arithmetic optimizer makes
    int pad = -1;        // Pad/PadV2 between the ReLU and the pool, or -1
    int pool = -1;
    int pool_grad = -1;  // -1: forward only
    int slice = -1;      // with a Pad: the Pad's gradient Slice between MaxPoolGrad and ReluGrad
    int relu_grad = -1;
    std::string z;       // the pre-ReLU tensor
    Window window;
    std::vector<std::pair<int, int>> shape_users;  // Shape nodes reading the ReLU (node, input)
  };

  // Data consumers of the nodes a pattern can involve.
  void IndexConsumers() {
    static const std::unordered_set<std::string> kOps = {
        "Relu", "_FusedConv2D", "MaxPool", "MaxPoolV2", "MaxPoolGrad", "MaxPoolGradV2",
        "Pad", "PadV2", "Slice"};
    std::unordered_set<std::string_view> producers;  // names of nodes with an op of kOps
    for (const NodeDef& n : g_->node())
      if (kOps.count(n.op())) producers.insert(n.name());
    for (int i = 0; i < g_->node_size(); ++i) {
      const NodeDef& n = g_->node(i);
      for (int pos = 0; pos < n.input_size(); ++pos) {
        if (IsControl(n.input(pos)) || !producers.count(InputNode(n.input(pos)))) continue;
        Input in = ParseInput(n.input(pos));
        const int src = Find(in.node);
        if (src < 0 || !kOps.count(node(src).op())) continue;
        if (in.index > 0) has_port_gt0_.insert(in.node);
        consumers_[in.node + ":" + std::to_string(in.index)].push_back({i, pos});
      }
    }
  }
  const std::vector<std::pair<int, int>>& Consumers(const std::string& name, int port) const {
    static const std::vector<std::pair<int, int>> kNone;
    auto it = consumers_.find(name + ":" + std::to_string(port));
    return it == consumers_.end() ? kNone : it->second;
  }
  // Counts and explains a candidate left alone; returns false.
  bool Skip(const std::string& what, const std::string& why) {
    stats[kNotFused]++;
    const std::string text = what + " not fused: " + why;
    if (log_ == nullptr) SetText(&g_last_skip, text);
    Log(text);
    return false;
  }

  // "" when the nodes (indices; -1 skipped) that name a device name the same one, else what
  // differs. The fused nodes take one device: a pattern split over devices (model parallelism,
  // a strategy's placement) is left as placed. A node without a device (an unplaced graph, as
  // rewrite_graph sees it) goes where the placer puts it and agrees with any.
  std::string DeviceProblem(std::initializer_list<int> nodes) const {
    const NodeDef* first = nullptr;
    for (int i : nodes) {
      if (i < 0 || node(i).device().empty()) continue;
      const NodeDef& n = node(i);
      if (first == nullptr) {
        first = &n;
      } else if (n.device() != first->device()) {
        return "'" + first->name() + "' and '" + n.name() + "' are on different devices ('" +
               first->device() + "', '" + n.device() + "')";
      }
    }
    return "";
  }

  // "MaxPool 'p' after Relu 'r'" (and Pad 'x'): how refusals name a candidate.
  std::string Describe(int pool_i, int relu_i, int pad_i) const {
    std::string s = node(pool_i).op() + " '" + node(pool_i).name() + "'";
    if (relu_i >= 0) s += " after " + node(relu_i).op() + " '" + node(relu_i).name() + "'";
    if (pad_i >= 0) s += " and " + node(pad_i).op() + " '" + node(pad_i).name() + "'";
    return s;
  }

  std::string DeviceTypeOf(const NodeDef& n) const {
    const std::string type = DeviceType(n.device());
    return type.empty() && n.device().empty() ? default_device_type_ : type;
  }

  // Whether a kernel exists for `n` on its device.
  bool KernelExists(const NodeDef& n) const {
    const std::string type = DeviceTypeOf(n);
    if (type.empty()) return false;
    return tensorflow::KernelDefAvailable(tensorflow::DeviceType(type), n);
  }

  // The window of a pool or pool-gradient node, or the reason it cannot be fused.
  std::string ReadWindow(const NodeDef& n, Window* w) const {
    const bool v2 = n.op() == "MaxPoolV2" || n.op() == "MaxPoolGradV2";
    const std::vector<std::string> in = DataInputs(n);
    const size_t first = n.op() == "MaxPoolV2" ? 1 : 3;  // ksize's input position (V2 ops)
    for (int k = 0; k < 2; ++k) {
      const char* name = k == 0 ? "ksize" : "strides";
      std::vector<int64_t>* v = k == 0 ? &w->ksize : &w->strides;
      if (v2) {
        if (in.size() <= first + k || !ConstInts(in[first + k], v))
          return std::string(name) + " is not a constant";
      } else {
        const AttrValue* a = Attr(n, name);
        if (a == nullptr) return std::string(name) + " missing";
        v->assign(a->list().i().begin(), a->list().i().end());
      }
    }
    w->explicit_paddings.clear();
    if (const AttrValue* a = Attr(n, "explicit_paddings"))
      w->explicit_paddings.assign(a->list().i().begin(), a->list().i().end());
    return "";
  }

  // Why the pool's attributes and window cannot be fused, or "".
  std::string PoolProblem(const NodeDef& pool, Window* w) const {
    const std::string padding = StringAttr(pool, "padding", "");
    const std::string format = StringAttr(pool, "data_format", "NHWC");
    if (padding != "SAME" && padding != "VALID" && padding != "EXPLICIT")
      return "padding " + padding;
    if (format != "NHWC" && format != "NCHW") return "data_format " + format;
    const std::string problem = ReadWindow(pool, w);
    if (!problem.empty()) return problem;
    const bool nhwc = format == "NHWC";
    for (int k = 0; k < 2; ++k) {
      const std::string name = k == 0 ? "ksize" : "strides";
      const std::vector<int64_t>& v = k == 0 ? w->ksize : w->strides;
      if (v.size() != 4) return name + " not 4 entries";
      if (v[0] != 1 || v[nhwc ? 3 : 1] != 1) return name + " pools batch/channels";
      for (int64_t x : v)
        if (x <= 0 || x > 0x7fffffff) return name + " out of range";
    }
    // ksize has its 4 entries (above).
    return tf_relupool::CheckExplicitPaddings(
        padding == "EXPLICIT" ? tf_relupool::Padding::kExplicit
        : padding == "SAME"   ? tf_relupool::Padding::kSame
                              : tf_relupool::Padding::kValid,
        w->explicit_paddings.data(), static_cast<int>(w->explicit_paddings.size()),
        w->ksize.data(), nhwc ? tf_relupool::DataFormat::kNHWC : tf_relupool::DataFormat::kNCHW);
  }

  // Why the Pad cannot move past the ReLU, or "". relu(pad(z, c)) == pad(relu(z), c) element
  // by element when relu(c) == c bit for bit: Pad pads with +0, PadV2 with its constant, which
  // must then be non-negative with a clear sign bit (relu(-0) may be +0). Any paddings work (the
  // pool never mixes batch or channel entries, and padded entries are plain values).
  std::string PadProblem(const NodeDef& pad) const {
    if (pad.op() == "Pad") return "";
    const std::vector<std::string> in = DataInputs(pad);
    tensorflow::Tensor c;
    if (in.size() != 3 || !ConstInput(in[2], &c) || c.NumElements() != 1)
      return "has no constant constant_values";
    double v;
    switch (c.dtype()) {
      case tensorflow::DT_HALF: v = static_cast<float>(c.flat<Eigen::half>()(0)); break;
      case tensorflow::DT_BFLOAT16: v = static_cast<float>(c.flat<Eigen::bfloat16>()(0)); break;
      case tensorflow::DT_FLOAT: v = c.flat<float>()(0); break;
      case tensorflow::DT_DOUBLE: v = c.flat<double>()(0); break;
      default: return "constant_values of an unsupported dtype";
    }
    if (std::isnan(v) || std::signbit(v)) return "pads with a negative or NaN value";
    return "";
  }

  // Whether `begin` is paddings[:, 0] of the Pad's `paddings`: either both constants with those
  // values (after TF's constant folding), or _PadGrad's own subgraph on that paddings tensor,
  // Reshape(Slice(paddings, [0, 0], [rank, 1]), [-1]) (graphs not constant-folded yet).
  bool IsPadBefore(const std::string& begin, const std::string& paddings) const {
    std::vector<int64_t> values;
    tensorflow::Tensor pads;
    if (ConstInts(begin, &values)) {
      if (!ConstInput(paddings, &pads) || pads.dims() != 2 || pads.dim_size(1) != 2 ||
          pads.dim_size(0) != static_cast<int64_t>(values.size()))
        return false;
      for (size_t d = 0; d < values.size(); ++d) {
        const int64_t before = pads.dtype() == tensorflow::DT_INT32
                                   ? pads.matrix<int32_t>()(d, 0)
                                   : pads.dtype() == tensorflow::DT_INT64
                                         ? pads.matrix<int64_t>()(d, 0)
                                         : -1;
        if (before != values[d]) return false;
      }
      return true;
    }
    const int reshape_i = IsControl(begin) ? -1 : Find(ParseInput(begin).node);
    if (reshape_i < 0 || ParseInput(begin).index != 0 || node(reshape_i).op() != "Reshape")
      return false;
    const std::vector<std::string> r_in = DataInputs(node(reshape_i));
    if (r_in.size() != 2 || !ConstInts(r_in[1], &values) || values != std::vector<int64_t>{-1})
      return false;
    const Input cut = ParseInput(r_in[0]);
    const int cut_i = Find(cut.node);
    if (cut_i < 0 || cut.index != 0 || node(cut_i).op() != "Slice") return false;
    const std::vector<std::string> c_in = DataInputs(node(cut_i));
    if (c_in.size() != 3 || ParseInput(c_in[0]).node != ParseInput(paddings).node ||
        ParseInput(c_in[0]).index != ParseInput(paddings).index)
      return false;
    if (!ConstInts(c_in[1], &values) || values != std::vector<int64_t>{0, 0}) return false;
    // size [rank, 1]: a constant, or Pack(rank, 1).
    if (ConstInts(c_in[2], &values)) return values.size() == 2 && values[1] == 1;
    const Input size = ParseInput(c_in[2]);
    const int size_i = Find(size.node);
    if (size_i < 0 || size.index != 0 || node(size_i).op() != "Pack") return false;
    const std::vector<std::string> p_in = DataInputs(node(size_i));
    tensorflow::Tensor one;
    if (p_in.size() != 2 || !ConstInput(p_in[1], &one) || one.NumElements() != 1) return false;
    if (one.dtype() == tensorflow::DT_INT32) return one.flat<int32_t>()(0) == 1;
    if (one.dtype() == tensorflow::DT_INT64) return one.flat<int64_t>()(0) == 1;
    return false;
  }

  // Whether n is the MaxPoolGrad(V2) of `pool` (orig_input = pool's input, orig_output = pool)
  // with the same window and attributes.
  bool IsGradOf(const NodeDef& n, const NodeDef& pool, const Window& w,
                tensorflow::DataType t) const {
    if (!IsMaxPoolGrad(n)) return false;
    const std::vector<std::string> in = DataInputs(n);
    if (in.size() < 3) return false;
    const Input orig_out = ParseInput(in[1]);
    Window gw;
    return orig_out.node == pool.name() && orig_out.index == 0 && TypeAttr(n, "T") == t &&
           ReadWindow(n, &gw).empty() && gw == w &&
           StringAttr(n, "padding", "") == StringAttr(pool, "padding", "") &&
           StringAttr(n, "data_format", "NHWC") == StringAttr(pool, "data_format", "NHWC");
  }

  static std::string NameList(const std::vector<std::string>& names) {
    std::string list;
    for (const auto& o : names) list += (list.empty() ? "" : ", ") + o;
    return list;
  }

  bool Match(int pool_i, Plan* plan) {
    const NodeDef& pool = node(pool_i);
    const std::vector<std::string> pool_in = DataInputs(pool);
    if (pool_in.empty()) return false;
    Input src = ParseInput(pool_in[0]);
    int pad_i = -1;
    int relu_i = Find(src.node);
    if (relu_i < 0 || src.index != 0) return false;
    if (IsPad(node(relu_i))) {
      pad_i = relu_i;
      const std::vector<std::string> pad_in = DataInputs(node(pad_i));
      if (pad_in.empty()) return false;
      src = ParseInput(pad_in[0]);
      relu_i = Find(src.node);
      if (relu_i < 0 || src.index != 0) return false;
    }
    const NodeDef& relu = node(relu_i);
    bool fused_conv = false;
    if (relu.op() == "_FusedConv2D") {
      const AttrValue* ops = Attr(relu, "fused_ops");
      const int n_ops = ops == nullptr ? 0 : ops->list().s_size();
      if (n_ops == 0 || ops->list().s(n_ops - 1) != "Relu")
        return false;  // not a ReLU feeding the pool
      fused_conv = true;
    } else if (relu.op() != "Relu") {
      return false;  // not a ReLU + max pool pattern: nothing to say
    }
    // From here on it is a candidate: every refusal is counted and explained.
    const std::string what = Describe(pool_i, relu_i, pad_i);
    const tensorflow::DataType t = TypeAttr(pool, "T");
    if (!SupportedType(t) || TypeAttr(relu, "T") != t ||
        (pad_i >= 0 && TypeAttr(node(pad_i), "T") != t))
      return Skip(what, "dtype " + tensorflow::DataTypeString(t) + " not supported");
    Window window;
    std::string problem = PoolProblem(pool, &window);
    if (!problem.empty()) return Skip(what, problem);
    if (pad_i >= 0) {
      problem = PadProblem(node(pad_i));
      if (!problem.empty()) return Skip(what, "the " + node(pad_i).op() + " " + problem);
      if (Preserved(pad_i)) return Skip(what, "the Pad must be preserved (fetch/feed)");
    }
    if (Preserved(relu_i)) return Skip(what, "the Relu must be preserved (fetch/feed)");
    if (has_port_gt0_.count(relu.name()))
      return Skip(what, "'" + relu.name() + "' has consumers of another output");
    if (!fused_conv && DataInputs(relu).size() != 1)
      return Skip(what, "'" + relu.name() + "' has an unexpected input count");

    // The ReLU's consumers: the pool (or the Pad), the pool's gradient (without a Pad), its
    // ReluGrad, Shape nodes (rewired to z, same shape); nothing else.
    const int first = pad_i >= 0 ? pad_i : pool_i;
    int pool_grad_i = -1, relu_grad_i = -1;
    std::vector<std::pair<int, int>> shape_users;
    std::vector<std::string> others;
    for (const auto& c : Consumers(relu.name(), 0)) {
      const NodeDef& n = node(c.first);
      if (c.first == first && c.second == 0) continue;
      if (pad_i < 0 && c.second == 0 && pool_grad_i < 0 && IsGradOf(n, pool, window, t)) {
        pool_grad_i = c.first;
        continue;
      }
      if (n.op() == "ReluGrad" && c.second == 1 && relu_grad_i < 0) {
        relu_grad_i = c.first;  // checked below against the MaxPoolGrad
        continue;
      }
      if (IsShapeOnly(n)) {
        shape_users.push_back(c);
        continue;
      }
      others.push_back(n.name());
    }
    if (!others.empty()) return Skip(what, "the Relu has other consumers: " + NameList(others));
    if (pad_i >= 0) {
      const NodeDef& pad = node(pad_i);
      for (const auto& c : Consumers(pad.name(), 0)) {
        const NodeDef& n = node(c.first);
        if (c.first == pool_i && c.second == 0) continue;
        if (c.second == 0 && pool_grad_i < 0 && IsGradOf(n, pool, window, t)) {
          pool_grad_i = c.first;
          continue;
        }
        if (IsShapeOnly(n)) continue;  // same shape after the rewrite
        others.push_back(n.name());
      }
      if (!others.empty()) return Skip(what, "the Pad has other consumers: " + NameList(others));
    }
    if ((pool_grad_i < 0) != (relu_grad_i < 0))
      return Skip(what, "a MaxPoolGrad without its ReluGrad (or the reverse)");
    int slice_i = -1;
    if (pool_grad_i >= 0) {
      const NodeDef& pg = node(pool_grad_i);
      const NodeDef& rg = node(relu_grad_i);
      const auto& users = Consumers(pg.name(), 0);
      const std::vector<std::string> rg_in = DataInputs(rg);
      if (rg_in.size() != 2 || TypeAttr(rg, "T") != t)
        return Skip(what, "its ReluGrad '" + rg.name() + "' is unexpected");
      if (has_port_gt0_.count(pg.name()) || Preserved(pool_grad_i))
        return Skip(what, "its MaxPoolGrad '" + pg.name() + "' must be preserved");
      if (pad_i < 0) {
        if (users.size() != 1 || users[0].first != relu_grad_i || users[0].second != 0)
          return Skip(what, "its MaxPoolGrad '" + pg.name() + "' does not feed exactly its ReluGrad");
      } else {
        // The Pad's gradient: ReluGrad(Slice(MaxPoolGrad, begin, size), Relu) with begin the
        // Pad's leading paddings (array_grad.py, _PadGrad; constant-folded). ReluGrad needs its
        // two inputs of one shape, so the Slice's output has z's shape: it cuts exactly the
        // unpadded z out of the padded gradient, also out of the fused op's.
        slice_i = users.size() == 1 && users[0].second == 0 ? users[0].first : -1;
        if (slice_i < 0 || node(slice_i).op() != "Slice")
          return Skip(what, "its MaxPoolGrad '" + pg.name() + "' does not feed exactly a Slice");
        const NodeDef& slice = node(slice_i);
        const auto& slice_users = Consumers(slice.name(), 0);
        if (slice_users.size() != 1 || slice_users[0].first != relu_grad_i ||
            slice_users[0].second != 0 || has_port_gt0_.count(slice.name()) ||
            Preserved(slice_i) || TypeAttr(slice, "T") != t)
          return Skip(what, "the Slice '" + slice.name() + "' does not feed exactly its ReluGrad");
        const std::vector<std::string> slice_in = DataInputs(slice);
        const std::vector<std::string> pad_in = DataInputs(node(pad_i));
        if (slice_in.size() != 3 || pad_in.size() < 2 || !IsPadBefore(slice_in[1], pad_in[1]))
          return Skip(what, "the Slice '" + slice.name() + "' is not the Pad's gradient (its "
                      "begin is not the Pad's leading paddings)");
      }
    } else if (fused_conv) {
      return false;  // forward-only on a fused convolution: ReLU is already free, nothing to win
    }
    problem = DeviceProblem({relu_i, pad_i, pool_i, pool_grad_i, slice_i, relu_grad_i});
    if (!problem.empty()) return Skip(what, problem);

    plan->relu = relu_i;
    plan->fused_conv = fused_conv;
    plan->pad = pad_i;
    plan->pool = pool_i;
    plan->pool_grad = pool_grad_i;
    plan->slice = slice_i;
    plan->relu_grad = relu_grad_i;
    plan->z = fused_conv ? relu.name() : DataInputs(relu)[0];
    plan->window = window;
    plan->shape_users = shape_users;

    // The replacement nodes must have kernels on their devices.
    NodeDef fwd, bwd;
    BuildForward(*plan, &fwd);
    if (!KernelExists(fwd))
      return Skip(what, "no " + fwd.op() + " kernel for device '" + fwd.device() + "'");
    if (pool_grad_i >= 0) {
      BuildBackward(*plan, fwd, "unused_shape_name", &bwd);
      if (!KernelExists(bwd))
        return Skip(what, "no " + bwd.op() + " kernel for device '" + bwd.device() + "'");
    }
    return true;
  }

  // Relu(MaxPool(z)) with the MaxPool's only consumer the Relu: TF's arithmetic optimizer
  // (OptimizeMaxOrMinOfMonotonicStage) swaps MaxPool(Relu(z)) into this order when the Relu has
  // no other consumer, i.e. in forward-only graphs. One ReluMaxPool(z) named as the Relu.
  bool MatchReluOfPool(int relu_i, const std::unordered_set<int>& claimed, Plan* plan) {
    const NodeDef& relu = node(relu_i);
    const Input src = ParseInput(relu.input(0));
    const int pool_i = Find(src.node);
    if (pool_i < 0 || src.index != 0 || claimed.count(pool_i)) return false;
    const NodeDef& pool = node(pool_i);
    const std::string what = "Relu '" + relu.name() + "' after " + Describe(pool_i, -1, -1);
    const tensorflow::DataType t = TypeAttr(pool, "T");
    if (!SupportedType(t) || TypeAttr(relu, "T") != t)
      return Skip(what, "dtype " + tensorflow::DataTypeString(t) + " not supported");
    Window window;
    std::string problem = PoolProblem(pool, &window);
    if (!problem.empty()) return Skip(what, problem);
    const auto& users = Consumers(pool.name(), 0);
    if (users.size() != 1 || users[0].first != relu_i || DataInputs(relu).size() != 1 ||
        has_port_gt0_.count(pool.name()))
      return Skip(what, "the MaxPool's output feeds more than the Relu");
    if (Preserved(pool_i)) return Skip(what, "the MaxPool must be preserved (fetch/feed)");
    problem = DeviceProblem({pool_i, relu_i});
    if (!problem.empty()) return Skip(what, problem);
    plan->relu_of_pool = true;
    plan->relu = relu_i;
    plan->pool = pool_i;
    plan->z = DataInputs(pool)[0];
    plan->window = window;
    NodeDef fwd;
    BuildForward(*plan, &fwd);
    if (!KernelExists(fwd))
      return Skip(what, "no " + fwd.op() + " kernel for device '" + fwd.device() + "'");
    return true;
  }

  void SetPoolAttrs(const Plan& p, NodeDef* n) {
    const NodeDef& pool = node(p.pool);
    auto* attr = n->mutable_attr();
    (*attr)["T"] = *Attr(pool, "T");
    (*attr)["padding"] = *Attr(pool, "padding");
    auto* ksize = (*attr)["ksize"].mutable_list();
    for (int64_t v : p.window.ksize) ksize->add_i(v);
    auto* strides = (*attr)["strides"].mutable_list();
    for (int64_t v : p.window.strides) strides->add_i(v);
    if (!p.window.explicit_paddings.empty()) {
      auto* pads = (*attr)["explicit_paddings"].mutable_list();
      for (int64_t v : p.window.explicit_paddings) pads->add_i(v);
    }
    (*attr)["data_format"].set_s(StringAttr(pool, "data_format", "NHWC"));
    (*attr)["implementation"].set_s("fused");
  }

  bool WithArgmax(const Plan& p) const { return p.pool_grad >= 0 && mode_ == kArgmax; }

  // The fused op's input: the pre-ReLU tensor, padded when there is a Pad.
  std::string PoolInput(const Plan& p) const { return p.pad >= 0 ? node(p.pad).name() : p.z; }

  void BuildForward(const Plan& p, NodeDef* fwd) {
    const NodeDef& pool = node(p.pool);
    const NodeDef& relu = node(p.relu);
    const NodeDef& named = p.relu_of_pool ? relu : pool;  // the node whose consumers it serves
    fwd->set_name(named.name());
    fwd->set_device(named.device());
    fwd->set_op(WithArgmax(p) ? "ReluMaxPoolWithWindowArgmax" : "ReluMaxPool");
    fwd->add_input(PoolInput(p));
    if (!p.fused_conv && p.pad < 0)
      for (const auto& c : ControlInputs(relu)) fwd->add_input(c);
    for (const auto& c : ControlInputs(pool)) fwd->add_input(c);
    SetPoolAttrs(p, fwd);
    if (WithArgmax(p)) {
      const bool nhwc = StringAttr(pool, "data_format", "NHWC") == "NHWC";
      (*fwd->mutable_attr())["Targmax"].set_type(ArgmaxType(p.window.ksize, nhwc));
    }
  }

  // Without a Pad the fused gradient replaces the ReluGrad (and takes its name); with a Pad it
  // replaces the MaxPoolGrad (its name), and the Pad's gradient Slice moves to the ReluGrad's.
  void BuildBackward(const Plan& p, const NodeDef& fwd, const std::string& shape_name,
                     NodeDef* bwd) {
    const NodeDef& pool = node(p.pool);
    const NodeDef& pg = node(p.pool_grad);
    const NodeDef& rg = node(p.relu_grad);
    const NodeDef& named = p.pad >= 0 ? pg : rg;
    const std::string dy = DataInputs(pg)[2];
    bwd->set_name(named.name());
    bwd->set_device(named.device());
    if (WithArgmax(p)) {
      bwd->set_op("ReluMaxPoolGradFromWindowArgmax");
      bwd->add_input(shape_name);
      bwd->add_input(dy);
      bwd->add_input(pool.name() + ":1");
    } else {
      bwd->set_op("ReluMaxPoolGrad");
      bwd->add_input(PoolInput(p));
      bwd->add_input(dy);
    }
    for (const auto& c : ControlInputs(pg)) bwd->add_input(c);
    if (p.pad < 0)
      for (const auto& c : ControlInputs(rg)) bwd->add_input(c);
    SetPoolAttrs(p, bwd);
    if (WithArgmax(p)) {
      (*bwd->mutable_attr())["Targmax"] = fwd.attr().at("Targmax");
      (*bwd->mutable_attr())["Tshape"].set_type(tensorflow::DT_INT32);
      // The codes come straight from the fused forward: valid by construction (as ops.py's
      // gradient does; on a GPU this saves the host round trip that reports invalid codes).
      (*bwd->mutable_attr())["validate_window_argmax"].set_b(false);
    }
  }

  void Apply(const Plan& p) {
    NodeDef fwd;
    BuildForward(p, &fwd);
    const NodeDef& relu = node(p.relu);
    const NodeDef& pool = node(p.pool);
    const bool v2 = pool.op() == "MaxPoolV2";
    if (p.relu_of_pool) {
      removed_[pool.name()] = relu.name();
      stats[kFusedForwardOnly]++;
      if (v2) stats[kFusedMaxPoolV2]++;
      Log("fused " + pool.op() + " '" + pool.name() + "' + Relu '" + relu.name() + "' -> " +
          fwd.op());
      *g_->mutable_node(p.relu) = std::move(fwd);
      return;
    }
    const std::string relu_text = relu.op() + " '" + relu.name() + "'";
    const std::string pad_text =
        p.pad >= 0 ? " + " + node(p.pad).op() + " '" + node(p.pad).name() + "'" : "";
    if (p.fused_conv) {
      // The convolution keeps its ReLU and stays the one kernel stock runs (cuDNN's
      // conv + bias + ReLU on a GPU): its output a = relu(conv + bias) is the fused op's input.
      // tf_relupool's ReLU keeps every value that is not < 0 bit for bit, so relu(a) == a and
      // the fused op computes stock's max_pool(a) and ReluGrad(MaxPoolGrad(a, .), a) exactly.
      stats[kFusedConvRelu]++;
    } else if (p.pad >= 0) {
      // The Pad now pads z: pad(z) is what the fused op applies ReLU + pooling to.
      NodeDef* pad = g_->mutable_node(p.pad);
      pad->set_input(0, p.z);
      for (const auto& c : ControlInputs(relu)) pad->add_input(c);
      removed_[relu.name()] = pad->name();
    } else {
      removed_[relu.name()] = pool.name();
    }
    if (!p.fused_conv)
      for (const auto& u : p.shape_users) g_->mutable_node(u.first)->set_input(u.second, p.z);
    if (p.pad >= 0) stats[kFusedThroughPad]++;
    if (v2) stats[kFusedMaxPoolV2]++;
    if (p.pool_grad >= 0) {
      const NodeDef& rg = node(p.relu_grad);
      const NodeDef& pg = node(p.pool_grad);
      const std::string grad_text =
          " and their gradient " + pg.op() + " '" + pg.name() + "' + ReluGrad '" + rg.name() + "'";
      std::string shape_name;
      if (WithArgmax(p)) {
        NodeDef shape;
        shape_name = UniqueName(rg.name() + "/input_shape");
        shape.set_name(shape_name);
        shape.set_op("Shape");
        shape.set_device(rg.device());
        shape.add_input(PoolInput(p));
        (*shape.mutable_attr())["T"] = *Attr(pool, "T");
        (*shape.mutable_attr())["out_type"].set_type(tensorflow::DT_INT32);
        added_.push_back(std::move(shape));
      }
      NodeDef bwd;
      BuildBackward(p, fwd, shape_name, &bwd);
      if (p.pad < 0) {
        removed_[pg.name()] = rg.name();
        *g_->mutable_node(p.relu_grad) = std::move(bwd);
      } else {
        // MaxPoolGrad -> fused gradient (same name); the Slice takes the ReluGrad's name and
        // place, so the ReluGrad's consumers read the sliced fused gradient.
        NodeDef slice = node(p.slice);
        slice.set_name(rg.name());
        slice.set_device(rg.device());
        for (const auto& c : ControlInputs(rg)) slice.add_input(c);
        removed_[node(p.slice).name()] = rg.name();
        *g_->mutable_node(p.relu_grad) = std::move(slice);
        *g_->mutable_node(p.pool_grad) = std::move(bwd);
      }
      stats[kFusedWithGrad]++;
      Log("fused " + relu_text + pad_text + " + " + pool.op() + " '" + pool.name() + "'" +
          grad_text + " -> " + fwd.op());
    } else {
      stats[kFusedForwardOnly]++;
      Log("fused " + relu_text + pad_text + " + " + pool.op() + " '" + pool.name() + "' -> " +
          fwd.op());
    }
    *g_->mutable_node(p.pool) = std::move(fwd);
  }

  // Drops removed nodes, moves control edges on them to their replacements, appends new nodes.
  void Finish() {
    auto* nodes = g_->mutable_node();
    int kept = 0;
    for (int r = 0; r < nodes->size(); ++r) {
      NodeDef* n = nodes->Mutable(r);
      if (removed_.count(n->name())) continue;
      bool touches = false;
      for (const auto& in : n->input())
        touches = touches || (IsControl(in) && removed_.count(in.substr(1)));
      if (touches) {
        std::vector<std::string> fixed;
        std::set<std::string> seen_controls;
        for (const auto& in : n->input()) {
          std::string v = in;
          if (IsControl(v)) {
            auto it = removed_.find(v.substr(1));
            if (it != removed_.end()) v = "^" + it->second;
            if (v.substr(1) == n->name() || !seen_controls.insert(v).second) continue;
          }
          fixed.push_back(v);
        }
        n->clear_input();
        for (auto& v : fixed) n->add_input(v);
      }
      if (kept != r) nodes->SwapElements(kept, r);
      ++kept;
    }
    nodes->DeleteSubrange(kept, nodes->size() - kept);
    for (NodeDef& n : added_) *g_->add_node() = std::move(n);
  }

  int mode_;
  std::string default_device_type_;
  std::unordered_map<std::string, std::vector<std::pair<int, int>>> consumers_;
  std::unordered_set<std::string> has_port_gt0_;
  std::unordered_map<std::string, std::string> removed_;  // removed node -> its replacement
};

// ---- Layout: the fused ops' own NCHW form instead of TF's layout-optimizer transposes ----
//
// On a GPU, TensorFlow's layout optimizer turns NHWC convolutions and pools into NCHW and wraps
// every op it does not know, ours included, in Transposes:
//   Conv2D(NCHW) -> Transpose(0,2,3,1) -> ReluMaxPool*(NHWC) -> Transpose(0,3,1,2) -> ...
// Each Transpose writes a full copy of its tensor, so the NHWC fused ops of a model built with
// tf_relupool's layers (or rewrite_model) cost more transient memory than stock pooling. The
// fused ops have an NCHW form: an op whose activation input is such a Transpose is switched to
// NCHW, reads the Transpose's input, and its outputs' Transposes back to NCHW disappear. The
// fused forward and the ops reading its window_argmax codes switch together (the codes follow
// the layout). Any input or consumer that is not such a Transpose gets one (exact: transposes
// move values); a Transpose left without consumers is removed.
class TransposeFolder : public GraphPass {
 public:
  TransposeFolder(GraphDef* graph, const std::unordered_set<std::string>* preserve,
                  std::vector<std::string>* log)
      : GraphPass(graph, preserve, log) {}

  int64_t removed_transposes = 0;

  // Number of fused ops switched to NCHW.
  int Run() {
    std::vector<int> starts;
    for (int i = 0; i < g_->node_size(); ++i) {
      const NodeDef& n = g_->node(i);
      if (IsFusedOp(n) && StringAttr(n, "data_format", "NHWC") == "NHWC") starts.push_back(i);
    }
    if (starts.empty()) return 0;
    // Cheap pre-check (most graphs off a GPU): does any fused op read a Transpose at all?
    std::unordered_set<std::string_view> transposes;
    for (const NodeDef& n : g_->node())
      if (n.op() == "Transpose") transposes.insert(n.name());
    bool reads_transpose = false;
    for (int i : starts)
      reads_transpose = reads_transpose || transposes.count(InputNode(ActivationInput(node(i))));
    if (!reads_transpose) return 0;
    IndexNames();
    bool any_start = false;
    for (int i : starts) any_start = any_start || FromNchw(ActivationInput(node(i))) != "";
    if (!any_start) return 0;  // the usual case off a GPU: no consumer index needed
    IndexConsumers();
    std::unordered_set<int> done;
    int converted = 0;
    for (int i : starts) {
      if (done.count(i)) continue;
      // A unit: a forward with its code readers, or a reader alone (converted with its forward).
      std::vector<int> unit;
      if (!Unit(i, &unit)) continue;
      for (int u : unit) done.insert(u);
      bool worth = false;
      for (int u : unit) worth = worth || FromNchw(ActivationInput(node(u))) != "";
      if (!worth) continue;
      std::string why;
      for (int u : unit)
        if (Preserved(node(u).name())) why = "'" + node(u).name() + "' must be preserved";
      if (!why.empty()) {
        Log(node(i).op() + " '" + node(i).name() + "' kept in NHWC: " + why);
        continue;
      }
      unit_.clear();
      for (int u : unit) unit_.insert(node(u).name());
      for (int u : unit) Convert(u);
      converted += static_cast<int>(unit.size());
    }
    if (converted == 0) return 0;
    Finish();
    return converted;
  }

 private:
  static bool IsFusedOp(const NodeDef& n) {
    return n.op() == "ReluMaxPool" || n.op() == "ReluMaxPoolWithWindowArgmax" ||
           n.op() == "ReluMaxPoolGrad" || n.op() == "ReluMaxPoolGradFromWindowArgmax" ||
           n.op() == "ReluMaxPoolGradGradFromWindowArgmax";
  }
  // Input positions holding 4-D activations (NHWC now), the window_argmax input, the shape input.
  static std::vector<int> ActivationInputs(const NodeDef& n) {
    if (n.op() == "ReluMaxPoolGrad") return {0, 1};
    if (n.op() == "ReluMaxPoolGradFromWindowArgmax") return {1};
    return {0};  // ReluMaxPool, ReluMaxPoolWithWindowArgmax: input; GradGrad: grad
  }
  static int ArgmaxInput(const NodeDef& n) {
    if (n.op() == "ReluMaxPoolGradFromWindowArgmax") return 2;
    if (n.op() == "ReluMaxPoolGradGradFromWindowArgmax") return 1;
    return -1;
  }
  // The input that decides whether converting pays: the pre-ReLU input (forward, keep=input
  // gradient) or the incoming gradient (gradient from codes, gradient of the gradient).
  static std::string ActivationInput(const NodeDef& n) {
    int k = 0, want = ActivationInputs(n)[0];
    for (const auto& in : n.input()) {
      if (IsControl(in)) continue;
      if (k++ == want) return in;
    }
    return "";
  }

  void IndexConsumers() {
    for (int i = 0; i < g_->node_size(); ++i) {
      const NodeDef& n = g_->node(i);
      for (int pos = 0; pos < n.input_size(); ++pos) {
        const Input in = ParseInput(n.input(pos));
        consumers_[in.node].push_back({i, pos});
      }
    }
  }

  // Whether the 1-D constant `input` holds exactly `perm`.
  bool IsPerm(const std::string& input, const std::vector<int64_t>& perm) const {
    std::vector<int64_t> values;
    return ConstInts(input, &values) && values == perm;
  }
  bool IsTranspose(const NodeDef& n, const std::vector<int64_t>& perm) const {
    const std::vector<std::string> in = DataInputs(n);
    return n.op() == "Transpose" && in.size() == 2 && IsPerm(in[1], perm);
  }
  // If `input` is Transpose(x, [0, 2, 3, 1]) (NCHW -> NHWC), x; else "".
  std::string FromNchw(const std::string& input) const {
    if (input.empty() || IsControl(input)) return "";
    const Input in = ParseInput(input);
    const int i = Find(in.node);
    if (i < 0 || in.index != 0 || !IsTranspose(node(i), {0, 2, 3, 1})) return "";
    return DataInputs(node(i))[0];
  }

  // The forward and every op reading its codes (all must be ours), starting from any of them.
  bool Unit(int i, std::vector<int>* unit) {
    int fwd = i;
    const int arg_pos = ArgmaxInput(node(i));
    if (arg_pos >= 0) {
      const Input in = ParseInput(node(i).input(arg_pos));
      fwd = Find(in.node);
      if (fwd < 0 || node(fwd).op() != "ReluMaxPoolWithWindowArgmax") return false;
    }
    unit->push_back(fwd);
    if (node(fwd).op() != "ReluMaxPoolWithWindowArgmax") return true;
    if (StringAttr(node(fwd), "data_format", "NHWC") != "NHWC") return false;
    for (const auto& c : consumers_[node(fwd).name()]) {
      const NodeDef& n = node(c.first);
      const Input in = ParseInput(n.input(c.second));
      if (in.index != 1) continue;  // output 0, or a control edge
      if (ArgmaxInput(n) != c.second) continue;  // not ours (e.g. a ZerosLike): gets NHWC codes
      if (StringAttr(n, "data_format", "NHWC") != "NHWC") {
        Log(node(fwd).op() + " '" + node(fwd).name() + "' kept in NHWC: its codes feed '" +
            n.name() + "' in NCHW");
        return false;
      }
      unit->push_back(c.first);
    }
    return true;
  }

  std::string PermConst(const std::string& base, const std::string& device,
                        const std::vector<int32_t>& perm) {
    NodeDef c;
    c.set_name(UniqueName(base));
    c.set_op("Const");
    c.set_device(device);
    (*c.mutable_attr())["dtype"].set_type(tensorflow::DT_INT32);
    tensorflow::Tensor t(tensorflow::DT_INT32, tensorflow::TensorShape({4}));
    for (int k = 0; k < 4; ++k) t.flat<int32_t>()(k) = perm[k];
    t.AsProtoTensorContent((*c.mutable_attr())["value"].mutable_tensor());
    added_.push_back(c);
    return c.name();
  }
  std::string AddTranspose(const std::string& base, const std::string& x, tensorflow::DataType t,
                           const std::string& device, const std::vector<int32_t>& perm) {
    NodeDef n;
    n.set_name(UniqueName(base));
    n.set_op("Transpose");
    n.set_device(device);
    n.add_input(x);
    n.add_input(PermConst(n.name() + "/perm", device, perm));
    (*n.mutable_attr())["T"].set_type(t);
    (*n.mutable_attr())["Tperm"].set_type(tensorflow::DT_INT32);
    added_.push_back(n);
    return n.name();
  }

  // The shape input of a gradient from codes, in NCHW order.
  std::string ShapeToNchw(const NodeDef& op, const std::string& input) {
    const Input in = ParseInput(input);
    const int i = Find(in.node);
    if (i >= 0 && in.index == 0 && node(i).op() == "Shape") {
      const std::string x = FromNchw(DataInputs(node(i))[0]);
      if (!x.empty()) {  // Shape(Transpose(x)) -> Shape(x)
        NodeDef s = node(i);
        s.set_name(UniqueName(node(i).name() + "/nchw"));
        s.set_device(op.device());
        s.clear_input();
        s.add_input(x);
        added_.push_back(s);
        touched_.push_back(node(i).name());  // the old Shape, and through it the Transpose
        return s.name();
      }
    }
    NodeDef p;  // a permutation of the 4 entries, on any device (host memory on a GPU)
    p.set_name(UniqueName(op.name() + "/input_shape_nchw"));
    p.set_op("DataFormatVecPermute");
    p.set_device(op.device());
    p.add_input(input);
    const AttrValue* tshape = Attr(op, "Tshape");  // absent: the op's default, int32
    if (tshape != nullptr) {
      (*p.mutable_attr())["T"] = *tshape;
    } else {
      (*p.mutable_attr())["T"].set_type(tensorflow::DT_INT32);
    }
    (*p.mutable_attr())["src_format"].set_s("NHWC");
    (*p.mutable_attr())["dst_format"].set_s("NCHW");
    added_.push_back(p);
    return p.name();
  }

  void Convert(int i) {
    NodeDef* n = g_->mutable_node(i);
    const tensorflow::DataType t = TypeAttr(*n, "T");
    const std::vector<int> acts = ActivationInputs(*n);
    int k = 0;
    for (int pos = 0; pos < n->input_size(); ++pos) {
      if (IsControl(n->input(pos))) continue;
      const int data_pos = k++;
      const std::string in = n->input(pos);
      if (std::find(acts.begin(), acts.end(), data_pos) != acts.end()) {
        const std::string x = FromNchw(in);
        if (!x.empty()) {
          n->set_input(pos, x);
          touched_.push_back(in);
        } else {
          n->set_input(pos, AddTranspose(n->name() + "/" + std::to_string(data_pos) + "_to_nchw",
                                         in, t, n->device(), {0, 3, 1, 2}));
        }
      } else if (n->op() == "ReluMaxPoolGradFromWindowArgmax" && data_pos == 0) {
        n->set_input(pos, ShapeToNchw(*n, in));
      }
    }
    // Attributes: NHWC [1, h, w, 1] -> NCHW [1, 1, h, w].
    auto* attr = n->mutable_attr();
    for (const char* name : {"ksize", "strides"}) {
      auto* list = (*attr)[name].mutable_list();
      if (list->i_size() != 4) continue;
      const int64_t v[4] = {list->i(0), list->i(1), list->i(2), list->i(3)};
      list->set_i(1, v[3]);
      list->set_i(2, v[1]);
      list->set_i(3, v[2]);
    }
    // explicit_paddings: (before, after) pairs, NHWC order -> NCHW order.
    auto pads = attr->find("explicit_paddings");
    if (pads != attr->end() && pads->second.list().i_size() == 8) {
      auto* list = pads->second.mutable_list();
      int64_t v[8];
      for (int e = 0; e < 8; ++e) v[e] = list->i(e);
      const int from[4] = {0, 3, 1, 2};  // NCHW dimension d is NHWC dimension from[d]
      for (int d = 0; d < 4; ++d) {
        list->set_i(2 * d, v[2 * from[d]]);
        list->set_i(2 * d + 1, v[2 * from[d] + 1]);
      }
    }
    (*attr)["data_format"].set_s("NCHW");
    // Output 0 (4-D in every op): Transposes back to NCHW go away; other readers get one NHWC
    // copy.
    std::vector<std::pair<int, int>> nhwc_readers;
    for (const auto& c : consumers_[n->name()]) {
      const NodeDef& user = node(c.first);
      const Input in = ParseInput(user.input(c.second));
      if (in.node != n->name() || in.index != 0) continue;  // control, codes, or rewired
      if (c.second == 0 && IsTranspose(user, {0, 3, 1, 2}) && !Preserved(user.name())) {
        removed_[user.name()] = n->name();
        removed_transposes++;
        touched_.push_back(DataInputs(user)[1]);  // its perm, when nothing else reads it
      } else {
        nhwc_readers.push_back(c);
      }
    }
    // Codes read by an op that is not one of ours (TF's gradient machinery adds a ZerosLike):
    // an NHWC copy of them.
    std::vector<std::pair<int, int>> code_readers;
    for (const auto& c : consumers_[n->name()]) {
      const Input in = ParseInput(node(c.first).input(c.second));
      if (in.node == n->name() && in.index == 1 && !unit_.count(node(c.first).name()))
        code_readers.push_back(c);
    }
    if (!code_readers.empty()) {
      const tensorflow::DataType code_type = TypeAttr(*n, "Targmax");  // absent: uint8
      const std::string back = AddTranspose(
          n->name() + "/window_argmax_nhwc", n->name() + ":1",
          code_type == tensorflow::DT_INVALID ? tensorflow::DT_UINT8 : code_type, n->device(),
          {0, 2, 3, 1});
      for (const auto& c : code_readers) g_->mutable_node(c.first)->set_input(c.second, back);
    }
    // Nodes added by earlier conversions read the NHWC output too (a Transpose to NCHW of it).
    std::vector<std::pair<size_t, int>> added_readers;
    for (size_t a = 0; a < added_.size(); ++a)
      for (int pos = 0; pos < added_[a].input_size(); ++pos) {
        const Input in = ParseInput(added_[a].input(pos));
        if (in.node == n->name() && in.index == 0) added_readers.push_back({a, pos});
      }
    if (!nhwc_readers.empty() || !added_readers.empty()) {
      const std::string back =
          AddTranspose(n->name() + "/to_nhwc", n->name(), t, n->device(), {0, 2, 3, 1});
      for (const auto& c : nhwc_readers) g_->mutable_node(c.first)->set_input(c.second, back);
      for (const auto& c : added_readers) added_[c.first].set_input(c.second, back);
    }
    Log(n->op() + " '" + n->name() + "' in NCHW between the layout optimizer's transposes");
  }

  // Rewires readers of removed Transposes to the fused op, drops the Transposes (and the Shape
  // and Const nodes feeding only them) that no node reads any more, appends new nodes.
  void Finish() {
    auto* nodes = g_->mutable_node();
    auto rewire = [&](NodeDef* n) {
      for (int pos = 0; pos < n->input_size(); ++pos) {
        const Input in = ParseInput(n->input(pos));
        auto it = removed_.find(in.node);
        if (it != removed_.end()) n->set_input(pos, in.index < 0 ? "^" + it->second : it->second);
      }
    };
    for (int r = 0; r < nodes->size(); ++r) rewire(nodes->Mutable(r));
    for (NodeDef& n : added_) rewire(&n);
    for (NodeDef& n : added_) *g_->add_node() = std::move(n);
    added_.clear();
    // Readers per node name, then unread candidates removed until none is left.
    std::unordered_map<std::string, int> readers;
    for (const NodeDef& n : g_->node())
      if (!removed_.count(n.name()))
        for (const auto& in : n.input()) readers[ParseInput(in).node]++;
    std::vector<std::string> candidates;
    for (const auto& in : touched_) candidates.push_back(ParseInput(in).node);
    std::unordered_set<std::string> dropped;
    while (!candidates.empty()) {
      const std::string name = candidates.back();
      candidates.pop_back();
      const int i = Find(name);
      if (i < 0 || dropped.count(name) || removed_.count(name) || readers[name] > 0 ||
          Preserved(name))
        continue;
      const std::string& op = node(i).op();
      if (op != "Transpose" && op != "Shape" && op != "Const") continue;
      dropped.insert(name);
      if (op == "Transpose") removed_transposes++;
      for (const auto& in : node(i).input()) {
        const std::string src = ParseInput(in).node;
        readers[src]--;
        candidates.push_back(src);
      }
    }
    int kept = 0;
    for (int r = 0; r < nodes->size(); ++r) {
      const std::string& name = nodes->Get(r).name();
      if (removed_.count(name) || dropped.count(name)) continue;
      if (kept != r) nodes->SwapElements(kept, r);
      ++kept;
    }
    nodes->DeleteSubrange(kept, nodes->size() - kept);
  }

  std::unordered_map<std::string, std::vector<std::pair<int, int>>> consumers_;  // all inputs
  std::unordered_map<std::string, std::string> removed_;  // Transpose -> the fused op
  std::vector<std::string> touched_;  // inputs (Transposes) the fused ops stopped reading
  std::unordered_set<std::string> unit_;  // names of the ops being converted together
};

// Every input of every node names a node of the graph ("" when so, else the first problem).
std::string DanglingInput(const GraphDef& graph) {
  std::unordered_set<std::string_view> names;
  names.reserve(graph.node_size());
  for (const auto& n : graph.node()) names.insert(n.name());
  for (const auto& n : graph.node())
    for (const auto& in : n.input())
      if (!names.count(InputNode(in))) return "'" + n.name() + "' input '" + in + "'";
  return "";
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
        Rewriter rewriter(&graph, mode, &preserve);
        TransposeFolder folder(&graph, &preserve, nullptr);
        int fused = 0, nchw = 0;
        if (have_preserve) {
          if (stock_pools) fused = rewriter.Run();
          nchw = folder.Run();
        }
        g_stats[kNotFused] += rewriter.stats[kNotFused];
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
              g_stats[k] += rewriter.stats[k];
            g_stats[kNchwOps] += nchw;
            g_stats[kTransposesRemoved] += folder.removed_transposes;
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
  int fused = Rewriter(&graph, mode, &preserve, "CPU", &lines).Run();
  fused += TransposeFolder(&graph, &preserve, &lines).Run();
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
