// The layout pass: the fused ops' own NCHW form instead of TensorFlow's layout-optimizer
// transposes. Runs after the fusion pass, whatever the switch (it changes no value).
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

#include "cc/grappler/fold_transposes.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace tf_relupool {
namespace grappler {
namespace {

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

}  // namespace

int FoldTransposes(GraphDef* graph, const std::unordered_set<std::string>* preserve,
                   std::vector<std::string>* log, int64_t* removed_transposes) {
  TransposeFolder folder(graph, preserve, log);
  const int switched = folder.Run();
  *removed_transposes += folder.removed_transposes;
  return switched;
}

}  // namespace grappler
}  // namespace tf_relupool
