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
//                   _FusedConv2D(fused_ops=[BiasAdd, Relu]) in place of Relu(z), with gradient:
//                   the convolution drops its Relu and produces z: fused_ops=[BiasAdd] on the
//                   CPU, Conv2D + BiasAdd elsewhere (the GPU kernel rejects [BiasAdd] alone)
//   forward only, after TF's arithmetic optimizer swapped them:
//                   Relu(MaxPool(z))                    -> ReluMaxPool(z)
//
// The Relu's output must have no consumers other than these; the fused forward takes the
// MaxPool's name and the fused gradient the ReluGrad's name, so their consumers need no change;
// control edges on removed nodes move to the node replacing them. Nothing is rewritten unless a
// kernel of the fused op exists for the node's device (KernelDefAvailable).
//
// Failure policy: the pass never fails the user's function. Anything unexpected (a parse error,
// an exception) returns TF_ABORTED, which MetaOptimizer::RunOptimizer treats as "did nothing"
// and keeps the graph it passed in; the first such error is logged once (LOG(WARNING)) and all
// are counted (tf_relupool_grappler_stats).

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tensorflow/c/experimental/grappler/grappler.h"
#include "google/protobuf/arena.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/graph.pb.h"
#include "tensorflow/core/framework/node_def.pb.h"
#include "tensorflow/core/framework/op_kernel.h"
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
  kCallsOff,           // ... of which returned at once because the switch was off
  kGraphsRewritten,    // graphs returned with at least one fusion
  kFusedWithGrad,      // forward + gradient fusions
  kFusedForwardOnly,   // forward-only fusions
  kFusedConvRelu,      // of the above, on a remapper _FusedConv2D(BiasAdd, Relu)
  kNotFused,           // ReLU + MaxPool candidates left in place (see last_skip)
  kErrors,             // unexpected errors (graph returned unchanged)
  kNanos,              // time spent inside optimize_func (ns)
  kBytesIn,            // serialized GraphDef bytes received
  kParseNanos,         // of kNanos, parsing the GraphDef
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

bool SameAttr(const NodeDef& a, const NodeDef& b, const char* name) {
  const AttrValue* x = Attr(a, name);
  const AttrValue* y = Attr(b, name);
  if (x == nullptr || y == nullptr) return x == y;
  return x->SerializeAsString() == y->SerializeAsString();
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

// The narrowest code type for windows of ksize (the window may be smaller at run time).
tensorflow::DataType ArgmaxType(const NodeDef& pool, bool nhwc) {
  const auto& k = Attr(pool, "ksize")->list().i();
  const int64_t positions = k[nhwc ? 1 : 2] * k[nhwc ? 2 : 3];
  if (positions < 255) return tensorflow::DT_UINT8;
  if (positions < 65535) return tensorflow::DT_UINT16;
  return tensorflow::DT_INT32;
}

// Why the pool attributes cannot be fused, or "".
std::string PoolAttrProblem(const NodeDef& pool) {
  const std::string padding = StringAttr(pool, "padding", "");
  const std::string format = StringAttr(pool, "data_format", "NHWC");
  if (padding != "SAME" && padding != "VALID") return "padding " + padding;
  if (format != "NHWC" && format != "NCHW") return "data_format " + format;
  const bool nhwc = format == "NHWC";
  for (const char* name : {"ksize", "strides"}) {
    const AttrValue* a = Attr(pool, name);
    if (a == nullptr || a->list().i_size() != 4) return std::string(name) + " not 4 entries";
    const auto& v = a->list().i();
    if (v[0] != 1 || v[nhwc ? 3 : 1] != 1) return std::string(name) + " pools batch/channels";
    for (int64_t x : v)
      if (x <= 0 || x > 0x7fffffff) return std::string(name) + " out of range";
  }
  return "";
}

struct Plan {
  int relu = -1;       // Relu or _FusedConv2D node index
  bool fused_conv = false;
  bool relu_of_pool = false;  // Relu(MaxPool(z)): the order TF's arithmetic optimizer makes
  int pool = -1;
  int pool_grad = -1;  // -1: forward only
  int relu_grad = -1;
  std::string z;       // the pre-ReLU tensor
};

class Rewriter {
 public:
  Rewriter(GraphDef* graph, int mode, const std::unordered_set<std::string>* preserve)
      : g_(graph), mode_(mode), preserve_(preserve) {
    index_.reserve(g_->node_size());
    for (int i = 0; i < g_->node_size(); ++i) index_[g_->node(i).name()] = i;
  }

  // Number of fusions applied.
  int Run() {
    // Candidates first (a MaxPool fed by a Relu or a _FusedConv2D): most graphs have none, and
    // then the consumer index below is never built.
    std::vector<int> pools, relus;
    for (int i = 0; i < g_->node_size(); ++i) {
      const NodeDef& n = g_->node(i);
      const bool pool = n.op() == "MaxPool";
      if ((!pool && n.op() != "Relu") || n.input_size() == 0 || IsControl(n.input(0))) continue;
      const int src = Find(ParseInput(n.input(0)).node);
      if (src < 0) continue;
      const std::string& src_op = node(src).op();
      if (pool && (src_op == "Relu" || src_op == "_FusedConv2D")) pools.push_back(i);
      if (!pool && src_op == "MaxPool") relus.push_back(i);
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
  const NodeDef& node(int i) const { return g_->node(i); }

  // Data consumers of the nodes a pattern can involve.
  void IndexConsumers() {
    for (int i = 0; i < g_->node_size(); ++i) {
      const NodeDef& n = g_->node(i);
      for (int pos = 0; pos < n.input_size(); ++pos) {
        if (IsControl(n.input(pos))) continue;
        Input in = ParseInput(n.input(pos));
        const int src = Find(in.node);
        if (src < 0) continue;
        const std::string& op = node(src).op();
        if (op != "Relu" && op != "_FusedConv2D" && op != "MaxPoolGrad" && op != "MaxPool")
          continue;
        if (in.index > 0) has_port_gt0_.insert(in.node);
        consumers_[in.node + ":" + std::to_string(in.index)].push_back({i, pos});
      }
    }
  }
  int Find(const std::string& name) const {
    auto it = index_.find(name);
    return it == index_.end() ? -1 : it->second;
  }
  const std::vector<std::pair<int, int>>& Consumers(const std::string& name, int port) const {
    static const std::vector<std::pair<int, int>> kNone;
    auto it = consumers_.find(name + ":" + std::to_string(port));
    return it == consumers_.end() ? kNone : it->second;
  }
  bool Preserved(int i) const { return preserve_ != nullptr && preserve_->count(node(i).name()); }

  bool Skip(const NodeDef& pool, const std::string& why) {
    g_stats[kNotFused]++;
    const std::string text = "MaxPool '" + pool.name() + "' not fused: " + why;
    SetText(&g_last_skip, text);
    if (g_verbose.load()) LOG(INFO) << "tf_relupool grappler: " << text;
    return false;
  }

  // Whether a kernel exists for `n` on `device` (its type, e.g. "GPU").
  static bool KernelExists(const NodeDef& n, const std::string& device) {
    const std::string type = DeviceType(device);
    if (type.empty()) return false;
    return tensorflow::KernelDefAvailable(tensorflow::DeviceType(type), n);
  }

  bool Match(int pool_i, Plan* plan) {
    const NodeDef& pool = node(pool_i);
    const std::vector<std::string> pool_in = DataInputs(pool);
    if (pool_in.empty()) return false;
    const Input src = ParseInput(pool_in[0]);
    const int relu_i = Find(src.node);
    if (relu_i < 0 || src.index != 0) return false;
    const NodeDef& relu = node(relu_i);
    bool fused_conv = false;
    if (relu.op() == "_FusedConv2D") {
      const AttrValue* ops = Attr(relu, "fused_ops");
      if (ops == nullptr || ops->list().s_size() != 2 || ops->list().s(0) != "BiasAdd" ||
          ops->list().s(1) != "Relu")
        return false;  // not a ReLU feeding the pool
      fused_conv = true;
    } else if (relu.op() != "Relu") {
      return false;  // not a ReLU + max pool pattern: nothing to say
    }
    // From here on it is a candidate: every refusal is counted and explained.
    const tensorflow::DataType t = TypeAttr(pool, "T");
    if (!SupportedType(t) || TypeAttr(relu, "T") != t)
      return Skip(pool, "dtype " + tensorflow::DataTypeString(t) + " not supported");
    std::string problem = PoolAttrProblem(pool);
    if (!problem.empty()) return Skip(pool, problem);
    if (Preserved(relu_i)) return Skip(pool, "'" + relu.name() + "' must be preserved (fetch/feed)");
    if (has_port_gt0_.count(relu.name()))
      return Skip(pool, "'" + relu.name() + "' has consumers of another output");
    if (!fused_conv && DataInputs(relu).size() != 1)
      return Skip(pool, "'" + relu.name() + "' has an unexpected input count");

    int pool_grad_i = -1, relu_grad_i = -1;
    std::vector<std::string> others;
    for (const auto& c : Consumers(relu.name(), 0)) {
      const NodeDef& n = node(c.first);
      if (c.first == pool_i && c.second == 0) continue;
      if (n.op() == "MaxPoolGrad" && c.second == 0 && pool_grad_i < 0) {
        const std::vector<std::string> in = DataInputs(n);
        const Input orig_out = in.size() == 3 ? ParseInput(in[1]) : Input{"", -1};
        if (orig_out.node == pool.name() && orig_out.index == 0 && TypeAttr(n, "T") == t &&
            SameAttr(n, pool, "ksize") && SameAttr(n, pool, "strides") &&
            SameAttr(n, pool, "padding") &&
            StringAttr(n, "data_format", "NHWC") == StringAttr(pool, "data_format", "NHWC")) {
          pool_grad_i = c.first;
          continue;
        }
      }
      if (n.op() == "ReluGrad" && c.second == 1 && relu_grad_i < 0) {
        relu_grad_i = c.first;  // checked below against the MaxPoolGrad
        continue;
      }
      others.push_back(n.name());
    }
    if (!others.empty()) {
      std::string list;
      for (const auto& o : others) list += (list.empty() ? "" : ", ") + o;
      return Skip(pool, "'" + relu.name() + "' has other consumers: " + list);
    }
    if ((pool_grad_i < 0) != (relu_grad_i < 0))
      return Skip(pool, "a MaxPoolGrad without its ReluGrad (or the reverse)");
    if (pool_grad_i >= 0) {
      const NodeDef& pg = node(pool_grad_i);
      const NodeDef& rg = node(relu_grad_i);
      const auto& users = Consumers(pg.name(), 0);
      const std::vector<std::string> rg_in = DataInputs(rg);
      if (users.size() != 1 || users[0].first != relu_grad_i || users[0].second != 0 ||
          rg_in.size() != 2 || TypeAttr(rg, "T") != t)
        return Skip(pool, "its MaxPoolGrad '" + pg.name() + "' does not feed exactly its ReluGrad");
      if (has_port_gt0_.count(pg.name()) || Preserved(pool_grad_i))
        return Skip(pool, "its MaxPoolGrad '" + pg.name() + "' must be preserved");
    } else if (fused_conv) {
      return false;  // forward-only on a fused convolution: ReLU is already free, nothing to win
    }
    if (fused_conv && Preserved(relu_i))
      return Skip(pool, "'" + relu.name() + "' must be preserved (fetch/feed)");

    plan->relu = relu_i;
    plan->fused_conv = fused_conv;
    plan->pool = pool_i;
    plan->pool_grad = pool_grad_i;
    plan->relu_grad = relu_grad_i;
    plan->z = fused_conv ? relu.name() : DataInputs(relu)[0];

    // The replacement nodes must have kernels on their devices.
    if (fused_conv && !CpuDevice(relu)) {
      NodeDef conv, bias;
      SplitFusedConv(relu, "unused_conv_name", &conv, &bias);
      if (!KernelExists(conv, conv.device()) || !KernelExists(bias, bias.device()))
        return Skip(pool, "no Conv2D/BiasAdd kernel for device '" + relu.device() + "'");
    }
    NodeDef fwd, bwd;
    BuildForward(*plan, &fwd);
    if (!KernelExists(fwd, fwd.device()))
      return Skip(pool, "no " + fwd.op() + " kernel for device '" + fwd.device() + "'");
    if (pool_grad_i >= 0) {
      BuildBackward(*plan, fwd, "unused_shape_name", &bwd);
      if (!KernelExists(bwd, bwd.device()))
        return Skip(pool, "no " + bwd.op() + " kernel for device '" + bwd.device() + "'");
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
    const tensorflow::DataType t = TypeAttr(pool, "T");
    if (!SupportedType(t) || TypeAttr(relu, "T") != t)
      return Skip(pool, "dtype " + tensorflow::DataTypeString(t) + " not supported");
    std::string problem = PoolAttrProblem(pool);
    if (!problem.empty()) return Skip(pool, problem);
    const auto& users = Consumers(pool.name(), 0);
    if (users.size() != 1 || users[0].first != relu_i || DataInputs(pool).size() != 1 ||
        DataInputs(relu).size() != 1)
      return Skip(pool, "its output feeds more than the Relu '" + relu.name() + "'");
    if (Preserved(pool_i)) return Skip(pool, "it must be preserved (fetch/feed)");
    plan->relu_of_pool = true;
    plan->relu = relu_i;
    plan->pool = pool_i;
    plan->z = DataInputs(pool)[0];
    NodeDef fwd;
    BuildForward(*plan, &fwd);
    if (!KernelExists(fwd, fwd.device()))
      return Skip(pool, "no " + fwd.op() + " kernel for device '" + fwd.device() + "'");
    return true;
  }

  static bool CpuDevice(const NodeDef& n) { return DeviceType(n.device()) == "CPU"; }

  // _FusedConv2D(x, filter, bias; fused_ops=[BiasAdd, Relu]) without its ReLU, off the CPU:
  // TF's GPU _FusedConv2D kernel rejects fused_ops=[BiasAdd] alone when it runs ("Fusion is not
  // implemented: [BiasAdd]", conv_ops_fused_impl.h), so the convolution is split back into
  // Conv2D + BiasAdd (the BiasAdd keeps the fused node's name).
  void SplitFusedConv(const NodeDef& f, const std::string& conv_name, NodeDef* conv,
                      NodeDef* bias) {
    const std::vector<std::string> in = DataInputs(f);
    conv->set_name(conv_name);
    conv->set_op("Conv2D");
    conv->set_device(f.device());
    conv->add_input(in.size() > 0 ? in[0] : "");
    conv->add_input(in.size() > 1 ? in[1] : "");
    for (const auto& c : ControlInputs(f)) conv->add_input(c);
    for (const char* name : {"T", "strides", "use_cudnn_on_gpu", "padding", "explicit_paddings",
                             "data_format", "dilations"}) {
      const AttrValue* a = Attr(f, name);
      if (a != nullptr) (*conv->mutable_attr())[name] = *a;
    }
    bias->set_name(f.name());
    bias->set_op("BiasAdd");
    bias->set_device(f.device());
    bias->add_input(conv_name);
    bias->add_input(in.size() > 2 ? in[2] : "");
    (*bias->mutable_attr())["T"] = *Attr(f, "T");
    (*bias->mutable_attr())["data_format"].set_s(StringAttr(f, "data_format", "NHWC"));
  }

  void SetPoolAttrs(const NodeDef& pool, NodeDef* n) {
    auto* attr = n->mutable_attr();
    for (const char* name : {"T", "ksize", "strides", "padding"}) (*attr)[name] = *Attr(pool, name);
    (*attr)["data_format"].set_s(StringAttr(pool, "data_format", "NHWC"));
    (*attr)["implementation"].set_s("fused");
  }

  bool WithArgmax(const Plan& p) const { return p.pool_grad >= 0 && mode_ == kArgmax; }

  void BuildForward(const Plan& p, NodeDef* fwd) {
    const NodeDef& pool = node(p.pool);
    const NodeDef& relu = node(p.relu);
    const NodeDef& named = p.relu_of_pool ? relu : pool;  // the node whose consumers it serves
    fwd->set_name(named.name());
    fwd->set_device(named.device());
    fwd->set_op(WithArgmax(p) ? "ReluMaxPoolWithWindowArgmax" : "ReluMaxPool");
    fwd->add_input(p.z);
    if (!p.fused_conv)
      for (const auto& c : ControlInputs(relu)) fwd->add_input(c);
    for (const auto& c : ControlInputs(pool)) fwd->add_input(c);
    SetPoolAttrs(pool, fwd);
    if (WithArgmax(p)) {
      const bool nhwc = StringAttr(pool, "data_format", "NHWC") == "NHWC";
      (*fwd->mutable_attr())["Targmax"].set_type(ArgmaxType(pool, nhwc));
    }
  }

  void BuildBackward(const Plan& p, const NodeDef& fwd, const std::string& shape_name,
                     NodeDef* bwd) {
    const NodeDef& pool = node(p.pool);
    const NodeDef& pg = node(p.pool_grad);
    const NodeDef& rg = node(p.relu_grad);
    const std::string dy = DataInputs(pg)[2];
    bwd->set_name(rg.name());
    bwd->set_device(rg.device());
    if (WithArgmax(p)) {
      bwd->set_op("ReluMaxPoolGradFromWindowArgmax");
      bwd->add_input(shape_name);
      bwd->add_input(dy);
      bwd->add_input(pool.name() + ":1");
    } else {
      bwd->set_op("ReluMaxPoolGrad");
      bwd->add_input(p.z);
      bwd->add_input(dy);
    }
    for (const auto& c : ControlInputs(pg)) bwd->add_input(c);
    for (const auto& c : ControlInputs(rg)) bwd->add_input(c);
    SetPoolAttrs(pool, bwd);
    if (WithArgmax(p)) {
      (*bwd->mutable_attr())["Targmax"] = fwd.attr().at("Targmax");
      (*bwd->mutable_attr())["Tshape"].set_type(tensorflow::DT_INT32);
    }
  }

  std::string UniqueName(const std::string& base) {
    std::string name = base;
    for (int i = 1; index_.count(name) || added_names_.count(name); ++i)
      name = base + "_" + std::to_string(i);
    added_names_.insert(name);
    return name;
  }

  void Apply(const Plan& p) {
    NodeDef fwd;
    BuildForward(p, &fwd);
    const NodeDef& relu = node(p.relu);
    if (p.relu_of_pool) {
      removed_[node(p.pool).name()] = relu.name();
      g_stats[kFusedForwardOnly]++;
      if (g_verbose.load())
        LOG(INFO) << "tf_relupool grappler: fused MaxPool '" << node(p.pool).name()
                  << "' + Relu '" << relu.name() << "' -> ReluMaxPool";
      *g_->mutable_node(p.relu) = std::move(fwd);
      return;
    }
    if (p.fused_conv && CpuDevice(relu)) {
      // The convolution now produces z: drop its ReLU (the CPU kernels, Eigen and oneDNN, run
      // fused_ops=[BiasAdd]; the values before the ReLU are the same bits).
      NodeDef* conv = g_->mutable_node(p.relu);
      auto* ops = (*conv->mutable_attr())["fused_ops"].mutable_list()->mutable_s();
      ops->RemoveLast();
      g_stats[kFusedConvRelu]++;
    } else if (p.fused_conv) {
      NodeDef conv, bias;
      SplitFusedConv(relu, UniqueName(relu.name() + "/conv"), &conv, &bias);
      added_.push_back(std::move(conv));
      *g_->mutable_node(p.relu) = std::move(bias);
      g_stats[kFusedConvRelu]++;
    } else {
      removed_[relu.name()] = node(p.pool).name();
    }
    if (p.pool_grad >= 0) {
      const NodeDef& rg = node(p.relu_grad);
      std::string shape_name;
      if (WithArgmax(p)) {
        NodeDef shape;
        shape_name = UniqueName(rg.name() + "/input_shape");
        shape.set_name(shape_name);
        shape.set_op("Shape");
        shape.set_device(rg.device());
        shape.add_input(p.z);
        (*shape.mutable_attr())["T"] = *Attr(node(p.pool), "T");
        (*shape.mutable_attr())["out_type"].set_type(tensorflow::DT_INT32);
        added_.push_back(std::move(shape));
      }
      NodeDef bwd;
      BuildBackward(p, fwd, shape_name, &bwd);
      removed_[node(p.pool_grad).name()] = rg.name();
      *g_->mutable_node(p.relu_grad) = std::move(bwd);
      g_stats[kFusedWithGrad]++;
    } else {
      g_stats[kFusedForwardOnly]++;
    }
    if (g_verbose.load())
      LOG(INFO) << "tf_relupool grappler: fused " << relu.op() << " '" << relu.name()
                << "' + MaxPool '" << node(p.pool).name() << "'"
                << (p.pool_grad >= 0 ? " and their gradient" : "") << " -> " << fwd.op();
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

  GraphDef* g_;
  int mode_;
  const std::unordered_set<std::string>* preserve_;
  std::unordered_map<std::string, int> index_;
  std::unordered_map<std::string, std::vector<std::pair<int, int>>> consumers_;
  std::unordered_set<std::string> has_port_gt0_;
  std::unordered_map<std::string, std::string> removed_;  // removed node -> its replacement
  std::unordered_set<std::string> added_names_;
  std::vector<NodeDef> added_;
};

// Every input of every node names a node of the graph ("" when so, else the first problem).
std::string DanglingInput(const GraphDef& graph) {
  std::unordered_set<std::string> names;
  for (const auto& n : graph.node()) names.insert(n.name());
  for (const auto& n : graph.node())
    for (const auto& in : n.input())
      if (!names.count(ParseInput(in).node)) return "'" + n.name() + "' input '" + in + "'";
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
  if (mode == kOff) {
    g_stats[kCallsOff]++;
    return;
  }
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
    g_stats[kBytesIn] += graph_buf->length;
    // Cheap pre-check on the serialized bytes: no "MaxPool" op name, nothing to do.
    if (memmem(graph_buf->data, graph_buf->length, "MaxPool", 7) != nullptr) {
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
        int fused = have_preserve ? Rewriter(&graph, mode, &preserve).Run() : 0;
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

}  // extern "C"
