// The family whose pool comes before the ReLU (patterns.h: max_pool_relu), rooted at the Relu:
// Relu(MaxPool(z)) with the MaxPool's only consumer the Relu. TF's arithmetic optimizer
// (OptimizeMaxOrMinOfMonotonicStage) swaps MaxPool(Relu(z)) into this order when the Relu has no
// other consumer, i.e. in forward-only graphs. One ReluMaxPool(z) named as the Relu. Tried after
// match_relu_then_pool.cc: a pool one of its plans took is left alone.

#include <string>
#include <utility>
#include <vector>

#include "cc/grappler/fused_nodes.h"
#include "cc/grappler/matchers.h"

namespace tf_relupool {
namespace grappler {
namespace {

const OpSet IsMaxPool({"pool"});
const OpSet IsRelu({"relu"});

class PoolThenRelu : public Matcher {
 public:
  bool IsCandidate(const FusionPass& pass, const NodeDef& n) const override {
    if (!IsRelu(n)) return false;
    const int src = pass.Source(n);
    return src >= 0 && IsMaxPool(pass.node(src));
  }

  bool Indexes(const NodeDef& n) const override { return IsMaxPool(n); }

  bool Match(FusionPass& pass, int relu_i, Plan* p) const override {
    const NodeDef& relu = pass.node(relu_i);
    const Input src = ParseInput(relu.input(0));
    const int pool_i = pass.Find(src.node);
    if (pool_i < 0 || src.index != 0 || pass.Claimed(pool_i)) return false;
    const NodeDef& pool = pass.node(pool_i);
    const std::string what = "Relu '" + relu.name() + "' after " + pass.Describe(pool_i, -1, -1);
    const tensorflow::DataType t = TypeAttr(pool, "T");
    if (!SupportedType(t) || TypeAttr(relu, "T") != t)
      return pass.Skip(what, "dtype " + tensorflow::DataTypeString(t) + " not supported");
    std::string problem = pass.PoolProblem(pool, &p->window);
    if (!problem.empty()) return pass.Skip(what, problem);
    const auto& users = pass.Consumers(pool.name(), 0);
    if (users.size() != 1 || users[0].first != relu_i || DataInputs(relu).size() != 1 ||
        pass.HasOtherPorts(pool.name()))
      return pass.Skip(what, "the MaxPool's output feeds more than the Relu");
    if (pass.Preserved(pool_i))
      return pass.Skip(what, "the MaxPool must be preserved (fetch/feed)");
    problem = pass.DeviceProblem({pool_i, relu_i});
    if (!problem.empty()) return pass.Skip(what, problem);
    p->relu_of_pool = true;
    p->relu = relu_i;
    p->pool = pool_i;
    p->z = DataInputs(pool)[0];
    problem = KernelProblem(pass, *p);
    return problem.empty() || pass.Skip(what, problem);
  }

  void Apply(FusionPass& pass, const Plan& p) const override {
    NodeDef fwd;
    BuildForward(pass, p, &fwd);
    const NodeDef& relu = pass.node(p.relu);
    const NodeDef& pool = pass.node(p.pool);
    pass.Remove(pool.name(), relu.name());
    pass.stats[kFusedForwardOnly]++;
    if (pool.op() == "MaxPoolV2") pass.stats[kFusedMaxPoolV2]++;
    pass.Log("fused " + pool.op() + " '" + pool.name() + "' + Relu '" + relu.name() + "' -> " +
             fwd.op());
    *pass.mutable_node(p.relu) = std::move(fwd);
  }
};

}  // namespace

std::unique_ptr<Matcher> PoolThenReluMatcher() { return std::make_unique<PoolThenRelu>(); }

}  // namespace grappler
}  // namespace tf_relupool
