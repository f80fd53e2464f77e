// fusion.h's core: candidates, the consumer index, refusals, the checks every family makes (dtype,
// devices, kernels, the pool's window) and the final cleanup of the graph.

#include "cc/grappler/fusion.h"

#include <set>
#include <string_view>

#include "cc/grappler/patterns.h"
#include "cc/kernels/relu_max_pool.h"  // CheckExplicitPaddings
#include "tensorflow/core/framework/op_kernel.h"

namespace tf_relupool {
namespace grappler {

OpSet::OpSet(std::initializer_list<const char*> roles, std::initializer_list<const char*> extra) {
  for (const char* role : roles)
    for (const std::string& op : RoleOps(role)) ops_.push_back(op);
  ops_.insert(ops_.end(), extra.begin(), extra.end());
}

bool SupportedType(tensorflow::DataType t) {
  return t == tensorflow::DT_HALF || t == tensorflow::DT_BFLOAT16 || t == tensorflow::DT_FLOAT ||
         t == tensorflow::DT_DOUBLE;
}

namespace {

const OpSet IsMaxPoolGrad({"pool_grad"});

}  // namespace

int FusionPass::Run() {
  // Candidates first: most graphs have none, and then the consumer index below is never built.
  std::vector<std::vector<int>> candidates(matchers_.size());
  bool any = false;
  for (int i = 0; i < g_->node_size(); ++i) {
    for (size_t m = 0; m < matchers_.size(); ++m) {
      if (matchers_[m]->IsCandidate(*this, node(i))) {
        candidates[m].push_back(i);
        any = true;
      }
    }
  }
  if (!any) return 0;
  IndexConsumers();
  std::vector<Plan> plans;
  for (size_t m = 0; m < matchers_.size(); ++m) {
    for (int i : candidates[m]) {
      Plan p;
      if (matchers_[m]->Match(*this, i, &p)) {
        p.matcher = matchers_[m].get();
        plans.push_back(p);
        claimed_.insert(p.pool);
      }
    }
  }
  if (plans.empty()) return 0;
  for (const Plan& p : plans) p.matcher->Apply(*this, p);
  Finish();
  return static_cast<int>(plans.size());
}

int FusionPass::Source(const NodeDef& n) const {
  if (n.input_size() == 0 || IsControl(n.input(0))) return -1;
  return Find(ParseInput(n.input(0)).node);
}

// Data consumers of the nodes a pattern can involve.
void FusionPass::IndexConsumers() {
  auto indexed = [this](const NodeDef& n) {
    for (const auto& m : matchers_)
      if (m->Indexes(n)) return true;
    return false;
  };
  std::unordered_set<std::string_view> producers;  // names of nodes with a pattern op
  for (const NodeDef& n : g_->node())
    if (indexed(n)) producers.insert(n.name());
  for (int i = 0; i < g_->node_size(); ++i) {
    const NodeDef& n = g_->node(i);
    for (int pos = 0; pos < n.input_size(); ++pos) {
      if (IsControl(n.input(pos)) || !producers.count(InputNode(n.input(pos)))) continue;
      Input in = ParseInput(n.input(pos));
      const int src = Find(in.node);
      if (src < 0 || !indexed(node(src))) continue;
      if (in.index > 0) has_port_gt0_.insert(in.node);
      consumers_[in.node + ":" + std::to_string(in.index)].push_back({i, pos});
    }
  }
}

const std::vector<std::pair<int, int>>& FusionPass::Consumers(const std::string& name,
                                                              int port) const {
  static const std::vector<std::pair<int, int>> kNone;
  auto it = consumers_.find(name + ":" + std::to_string(port));
  return it == consumers_.end() ? kNone : it->second;
}

bool FusionPass::Skip(const std::string& what, const std::string& why) {
  stats[kNotFused]++;
  const std::string text = what + " not fused: " + why;
  if (log_ == nullptr) SetText(&g_last_skip, text);
  Log(text);
  return false;
}

// The fused nodes take one device: a pattern split over devices (model parallelism, a strategy's
// placement) is left as placed. A node without a device (an unplaced graph, as rewrite_graph sees
// it) goes where the placer puts it and agrees with any.
std::string FusionPass::DeviceProblem(std::initializer_list<int> nodes) const {
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

std::string FusionPass::Describe(int pool_i, int relu_i, int pad_i) const {
  std::string s = node(pool_i).op() + " '" + node(pool_i).name() + "'";
  if (relu_i >= 0) s += " after " + node(relu_i).op() + " '" + node(relu_i).name() + "'";
  if (pad_i >= 0) s += " and " + node(pad_i).op() + " '" + node(pad_i).name() + "'";
  return s;
}

bool FusionPass::KernelExists(const NodeDef& n) const {
  std::string type = DeviceType(n.device());
  if (type.empty() && n.device().empty()) type = default_device_type_;
  if (type.empty()) return false;
  return tensorflow::KernelDefAvailable(tensorflow::DeviceType(type), n);
}

std::string FusionPass::ReadWindow(const NodeDef& n, Window* w) const {
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

std::string FusionPass::PoolProblem(const NodeDef& pool, Window* w) const {
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

bool FusionPass::IsGradOf(const NodeDef& n, const NodeDef& pool, const Window& w,
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

std::string FusionPass::NameList(const std::vector<std::string>& names) {
  std::string list;
  for (const auto& o : names) list += (list.empty() ? "" : ", ") + o;
  return list;
}

void FusionPass::Finish() {
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

}  // namespace grappler
}  // namespace tf_relupool
