// The fusion pass: stock ReLU + max pooling, and its gradient, become tf_relupool's fused ops.
// cc/grappler/README.md has the facts this relies on. The op types of each role below (pool,
// relu, pad, ...) and the list of patterns are patterns.h's table, which the trace-time fusion
// under XLA (tf_relupool/keras_fusion.py) reads too.
//
// Patterns, matched on the graph TensorFlow hands to plugin optimizers (after its own passes,
// remapper and layout optimizer included), or on a GraphDef given to tf_relupool.rewrite_graph:
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
// (KernelDefAvailable), nor a pattern whose nodes name different devices.
//
// plugin.cc runs the same pass inside Grappler and on a serialized GraphDef for
// tf_relupool.rewrite_graph, so the explicit Python API and the switch share one implementation.

#include "cc/grappler/fuse_relu_max_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cc/grappler/patterns.h"
#include "cc/kernels/relu_max_pool.h"  // CheckExplicitPaddings
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/platform/logging.h"

namespace tf_relupool {
namespace grappler {
namespace {

bool SupportedType(tensorflow::DataType t) {
  return t == tensorflow::DT_HALF || t == tensorflow::DT_BFLOAT16 || t == tensorflow::DT_FLOAT ||
         t == tensorflow::DT_DOUBLE;
}

// Whether a node's op plays one of some roles of patterns.h (or is one of `extra`). Built once, at
// load; a few op names each, so a scan (std::string compares lengths first) costs less than
// hashing the node's op name, and a union of roles is one scan.
class OpSet {
 public:
  explicit OpSet(std::initializer_list<const char*> roles,
                 std::initializer_list<const char*> extra = {}) {
    for (const char* role : roles)
      for (const std::string& op : RoleOps(role)) ops_.push_back(op);
    ops_.insert(ops_.end(), extra.begin(), extra.end());
  }
  bool operator()(const NodeDef& n) const {
    return std::find(ops_.begin(), ops_.end(), n.op()) != ops_.end();
  }

 private:
  std::vector<std::string> ops_;
};

const OpSet IsMaxPool({"pool"});
const OpSet IsMaxPoolGrad({"pool_grad"});
const OpSet IsPad({"pad"});
const OpSet IsRelu({"relu"});
const OpSet IsReluGrad({"relu_grad"});
const OpSet IsFusedConvRelu({"fused_conv_relu"});
const OpSet IsReluSource({"relu", "fused_conv_relu"});
// Ops that read only their input's shape: the same after the rewrite when fed z instead of relu(z).
const OpSet IsShapeOnly({"shape_only"});
// The nodes a pattern can involve, whose data consumers the pass indexes (a Slice: a Pad's
// gradient).
const OpSet IsPatternOp({"relu", "fused_conv_relu", "pool", "pool_grad", "pad"}, {"Slice"});

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
      if ((!pool && !IsRelu(n)) || n.input_size() == 0 || IsControl(n.input(0))) continue;
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
    std::unordered_set<std::string_view> producers;  // names of nodes with a pattern op
    for (const NodeDef& n : g_->node())
      if (IsPatternOp(n)) producers.insert(n.name());
    for (int i = 0; i < g_->node_size(); ++i) {
      const NodeDef& n = g_->node(i);
      for (int pos = 0; pos < n.input_size(); ++pos) {
        if (IsControl(n.input(pos)) || !producers.count(InputNode(n.input(pos)))) continue;
        Input in = ParseInput(n.input(pos));
        const int src = Find(in.node);
        if (src < 0 || !IsPatternOp(node(src))) continue;
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
    if (IsFusedConvRelu(relu)) {
      const AttrValue* ops = Attr(relu, "fused_ops");
      const int n_ops = ops == nullptr ? 0 : ops->list().s_size();
      if (n_ops == 0 || ops->list().s(n_ops - 1) != "Relu")
        return false;  // not a ReLU feeding the pool
      fused_conv = true;
    } else if (!IsRelu(relu)) {
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
      if (IsReluGrad(n) && c.second == 1 && relu_grad_i < 0) {
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

}  // namespace

int FuseReluMaxPool(GraphDef* graph, int mode, const std::unordered_set<std::string>* preserve,
                    const std::string& default_device_type, std::vector<std::string>* log,
                    int64_t* stats) {
  Rewriter rewriter(graph, mode, preserve, default_device_type, log);
  const int fused = rewriter.Run();
  for (int k = 0; k < kNumStats; ++k) stats[k] += rewriter.stats[k];
  return fused;
}

}  // namespace grappler
}  // namespace tf_relupool
