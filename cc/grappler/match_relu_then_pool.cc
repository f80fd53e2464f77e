// The family whose ReLU comes before the pool (patterns.h: relu_max_pool,
// fused_conv_relu_max_pool, relu_pad_max_pool), rooted at the pool:
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
//   a constant Pad between the ReLU and the pool (keras.applications ResNet/DenseNet stems,
//   ZeroPadding2D then MaxPooling2D), pad_link.h:
//                   MaxPool(Pad(Relu(z)))               -> Fused(Pad(z))
//                   ReluGrad(Slice(MaxPoolGrad(Pad, MaxPool, dy)), Relu(z))
//                                                       -> Slice(FusedGrad(Pad(z), dy))
//
// The Relu's output must have no consumers other than these (and shape-only ops: Shape, ShapeN,
// Rank, Size, rewired to z); the fused forward takes the MaxPool's name and the fused gradient
// the ReluGrad's name (with a Pad: the MaxPoolGrad's, and the Slice takes the ReluGrad's), so
// their consumers need no change; control edges on removed nodes move to the node replacing them.

#include <string>
#include <utility>
#include <vector>

#include "cc/grappler/fused_nodes.h"
#include "cc/grappler/matchers.h"
#include "cc/grappler/pad_link.h"

namespace tf_relupool {
namespace grappler {
namespace {

const OpSet IsMaxPool({"pool"});
const OpSet IsPad({"pad"});
const OpSet IsRelu({"relu"});
const OpSet IsReluGrad({"relu_grad"});
const OpSet IsFusedConvRelu({"fused_conv_relu"});
const OpSet IsReluSource({"relu", "fused_conv_relu"});
// Ops that read only their input's shape: the same after the rewrite when fed z instead of relu(z).
const OpSet IsShapeOnly({"shape_only"});
// The nodes whose data consumers a match reads (a Slice: a Pad's gradient).
const OpSet IsIndexed({"relu", "fused_conv_relu", "pool", "pool_grad", "pad"}, {"Slice"});

class ReluThenPool : public Matcher {
 public:
  bool IsCandidate(const FusionPass& pass, const NodeDef& n) const override {
    if (!IsMaxPool(n)) return false;
    const int src = pass.Source(n);
    return src >= 0 && (IsReluSource(pass.node(src)) || IsPad(pass.node(src)));
  }

  bool Indexes(const NodeDef& n) const override { return IsIndexed(n); }

  bool Match(FusionPass& pass, int pool_i, Plan* p) const override {
    p->pool = pool_i;
    if (!FindChain(pass, p)) return false;  // not a ReLU + max pool pattern: nothing to say
    // From here on it is a candidate: every refusal is counted and explained.
    const std::string what = pass.Describe(p->pool, p->relu, p->pad);
    const tensorflow::DataType t = TypeAttr(pass.node(p->pool), "T");
    std::string problem = NodeProblem(pass, p, t);
    if (problem.empty()) problem = ConsumersProblem(pass, p, t);
    if (problem.empty()) problem = GradientProblem(pass, p, t);
    if (!problem.empty()) return pass.Skip(what, problem);
    // Forward-only on a fused convolution: ReLU is already free, nothing to win.
    if (p->pool_grad < 0 && p->fused_conv) return false;
    problem = pass.DeviceProblem({p->relu, p->pad, p->pool, p->pool_grad, p->slice, p->relu_grad});
    if (problem.empty()) {
      const NodeDef& relu = pass.node(p->relu);
      p->z = p->fused_conv ? relu.name() : DataInputs(relu)[0];
      problem = KernelProblem(pass, *p);
    }
    return problem.empty() || pass.Skip(what, problem);
  }

  void Apply(FusionPass& pass, const Plan& p) const override;

 private:
  // The Pad (if any) and the ReLU source behind the pool; false when the chain is no candidate.
  static bool FindChain(const FusionPass& pass, Plan* p) {
    const std::vector<std::string> pool_in = DataInputs(pass.node(p->pool));
    if (pool_in.empty()) return false;
    Input src = ParseInput(pool_in[0]);
    p->relu = pass.Find(src.node);
    if (p->relu < 0 || src.index != 0) return false;
    if (IsPad(pass.node(p->relu))) {
      p->pad = p->relu;
      const std::vector<std::string> pad_in = DataInputs(pass.node(p->pad));
      if (pad_in.empty()) return false;
      src = ParseInput(pad_in[0]);
      p->relu = pass.Find(src.node);
      if (p->relu < 0 || src.index != 0) return false;
    }
    const NodeDef& relu = pass.node(p->relu);
    if (IsFusedConvRelu(relu)) {
      const AttrValue* ops = Attr(relu, "fused_ops");
      const int n_ops = ops == nullptr ? 0 : ops->list().s_size();
      p->fused_conv = true;
      return n_ops > 0 && ops->list().s(n_ops - 1) == "Relu";  // else no ReLU feeds the pool
    }
    return IsRelu(relu);
  }

  // The nodes' own attributes: dtypes, the pool's window, the Pad, what must be preserved.
  static std::string NodeProblem(const FusionPass& pass, Plan* p, tensorflow::DataType t) {
    const NodeDef& relu = pass.node(p->relu);
    if (!SupportedType(t) || TypeAttr(relu, "T") != t ||
        (p->pad >= 0 && TypeAttr(pass.node(p->pad), "T") != t))
      return "dtype " + tensorflow::DataTypeString(t) + " not supported";
    std::string problem = pass.PoolProblem(pass.node(p->pool), &p->window);
    if (!problem.empty()) return problem;
    if (p->pad >= 0) {
      problem = PadProblem(pass, pass.node(p->pad));
      if (!problem.empty()) return "the " + pass.node(p->pad).op() + " " + problem;
      if (pass.Preserved(p->pad)) return "the Pad must be preserved (fetch/feed)";
    }
    if (pass.Preserved(p->relu)) return "the Relu must be preserved (fetch/feed)";
    if (pass.HasOtherPorts(relu.name()))
      return "'" + relu.name() + "' has consumers of another output";
    if (!p->fused_conv && DataInputs(relu).size() != 1)
      return "'" + relu.name() + "' has an unexpected input count";
    return "";
  }

  // The ReLU's consumers: the pool (or the Pad), the pool's gradient (without a Pad), its
  // ReluGrad, Shape nodes (rewired to z, same shape); nothing else. Then the Pad's.
  static std::string ConsumersProblem(const FusionPass& pass, Plan* p, tensorflow::DataType t) {
    const NodeDef& pool = pass.node(p->pool);
    const int first = p->pad >= 0 ? p->pad : p->pool;
    std::vector<std::string> others;
    for (const auto& c : pass.Consumers(pass.node(p->relu).name(), 0)) {
      const NodeDef& n = pass.node(c.first);
      if (c.first == first && c.second == 0) continue;
      if (p->pad < 0 && c.second == 0 && p->pool_grad < 0 && pass.IsGradOf(n, pool, p->window, t)) {
        p->pool_grad = c.first;
        continue;
      }
      if (IsReluGrad(n) && c.second == 1 && p->relu_grad < 0) {
        p->relu_grad = c.first;  // checked in GradientProblem against the MaxPoolGrad
        continue;
      }
      if (IsShapeOnly(n)) {
        p->shape_users.push_back(c);
        continue;
      }
      others.push_back(n.name());
    }
    if (!others.empty()) return "the Relu has other consumers: " + FusionPass::NameList(others);
    return p->pad >= 0 ? PadConsumersProblem(pass, p, t) : "";
  }

  // The MaxPoolGrad and the ReluGrad come together, and the one feeds the other alone.
  static std::string GradientProblem(const FusionPass& pass, Plan* p, tensorflow::DataType t) {
    if ((p->pool_grad < 0) != (p->relu_grad < 0))
      return "a MaxPoolGrad without its ReluGrad (or the reverse)";
    if (p->pool_grad < 0) return "";
    const NodeDef& pg = pass.node(p->pool_grad);
    const NodeDef& rg = pass.node(p->relu_grad);
    if (DataInputs(rg).size() != 2 || TypeAttr(rg, "T") != t)
      return "its ReluGrad '" + rg.name() + "' is unexpected";
    if (pass.HasOtherPorts(pg.name()) || pass.Preserved(p->pool_grad))
      return "its MaxPoolGrad '" + pg.name() + "' must be preserved";
    if (p->pad >= 0) return PadGradientProblem(pass, p, t);
    const auto& users = pass.Consumers(pg.name(), 0);
    if (users.size() != 1 || users[0].first != p->relu_grad || users[0].second != 0)
      return "its MaxPoolGrad '" + pg.name() + "' does not feed exactly its ReluGrad";
    return "";
  }
};

void ReluThenPool::Apply(FusionPass& pass, const Plan& p) const {
  NodeDef fwd;
  BuildForward(pass, p, &fwd);
  const NodeDef& relu = pass.node(p.relu);
  const NodeDef& pool = pass.node(p.pool);
  const std::string relu_text = relu.op() + " '" + relu.name() + "'";
  const std::string pad_text =
      p.pad >= 0 ? " + " + pass.node(p.pad).op() + " '" + pass.node(p.pad).name() + "'" : "";
  if (p.fused_conv) {
    // The convolution keeps its ReLU and stays the one kernel stock runs (cuDNN's
    // conv + bias + ReLU on a GPU): its output a = relu(conv + bias) is the fused op's input.
    // tf_relupool's ReLU keeps every value that is not < 0 bit for bit, so relu(a) == a and
    // the fused op computes stock's max_pool(a) and ReluGrad(MaxPoolGrad(a, .), a) exactly.
    pass.stats[kFusedConvRelu]++;
  } else if (p.pad >= 0) {
    // The Pad now pads z: pad(z) is what the fused op applies ReLU + pooling to.
    NodeDef* pad = pass.mutable_node(p.pad);
    pad->set_input(0, p.z);
    for (const auto& c : ControlInputs(relu)) pad->add_input(c);
    pass.Remove(relu.name(), pad->name());
  } else {
    pass.Remove(relu.name(), pool.name());
  }
  if (!p.fused_conv)
    for (const auto& u : p.shape_users) pass.mutable_node(u.first)->set_input(u.second, p.z);
  if (p.pad >= 0) pass.stats[kFusedThroughPad]++;
  if (pool.op() == "MaxPoolV2") pass.stats[kFusedMaxPoolV2]++;
  const std::string fused_text = "fused " + relu_text + pad_text + " + " + pool.op() + " '" +
                                 pool.name() + "'";
  if (p.pool_grad >= 0) {
    const NodeDef& rg = pass.node(p.relu_grad);
    const NodeDef& pg = pass.node(p.pool_grad);
    const std::string grad_text =
        " and their gradient " + pg.op() + " '" + pg.name() + "' + ReluGrad '" + rg.name() + "'";
    std::string shape_name;
    if (WithArgmax(pass, p)) {
      NodeDef shape;
      shape_name = pass.UniqueName(rg.name() + "/input_shape");
      shape.set_name(shape_name);
      shape.set_op("Shape");
      shape.set_device(rg.device());
      shape.add_input(PoolInput(pass, p));
      (*shape.mutable_attr())["T"] = *Attr(pool, "T");
      (*shape.mutable_attr())["out_type"].set_type(tensorflow::DT_INT32);
      pass.Add(std::move(shape));
    }
    NodeDef bwd;
    BuildBackward(pass, p, fwd, shape_name, &bwd);
    if (p.pad < 0) {
      pass.Remove(pg.name(), rg.name());
      *pass.mutable_node(p.relu_grad) = std::move(bwd);
    } else {
      // MaxPoolGrad -> fused gradient (same name); the Slice takes the ReluGrad's name and
      // place, so the ReluGrad's consumers read the sliced fused gradient.
      NodeDef slice = pass.node(p.slice);
      slice.set_name(rg.name());
      slice.set_device(rg.device());
      for (const auto& c : ControlInputs(rg)) slice.add_input(c);
      pass.Remove(pass.node(p.slice).name(), rg.name());
      *pass.mutable_node(p.relu_grad) = std::move(slice);
      *pass.mutable_node(p.pool_grad) = std::move(bwd);
    }
    pass.stats[kFusedWithGrad]++;
    pass.Log(fused_text + grad_text + " -> " + fwd.op());
  } else {
    pass.stats[kFusedForwardOnly]++;
    pass.Log(fused_text + " -> " + fwd.op());
  }
  *pass.mutable_node(p.pool) = std::move(fwd);
}

}  // namespace

std::unique_ptr<Matcher> ReluThenPoolMatcher() { return std::make_unique<ReluThenPool>(); }

}  // namespace grappler
}  // namespace tf_relupool
