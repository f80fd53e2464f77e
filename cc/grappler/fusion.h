// The core of the fusion pass, shared by its matchers: FusionPass finds each matcher's candidate
// nodes, indexes the consumers of the nodes a pattern can involve, asks the matchers for a Plan
// per candidate, has each plan applied by its matcher and then drops the nodes the plans removed.
// A Matcher is one pattern family of patterns.h (match_relu_then_pool.cc,
// match_pool_then_relu.cc); fused_nodes.h builds the fused nodes of a plan.
#ifndef TF_RELUPOOL_CC_GRAPPLER_FUSION_H_
#define TF_RELUPOOL_CC_GRAPPLER_FUSION_H_

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cc/grappler/graph_util.h"
#include "cc/grappler/state.h"

namespace tf_relupool {
namespace grappler {

// Whether a node's op plays one of some roles of patterns.h (or is one of `extra`). Built once, at
// load; a few op names each, so a scan (std::string compares lengths first) costs less than
// hashing the node's op name, and a union of roles is one scan.
class OpSet {
 public:
  explicit OpSet(std::initializer_list<const char*> roles,
                 std::initializer_list<const char*> extra = {});
  bool operator()(const NodeDef& n) const {
    return std::find(ops_.begin(), ops_.end(), n.op()) != ops_.end();
  }

 private:
  std::vector<std::string> ops_;
};

// The dtypes the fused ops take.
bool SupportedType(tensorflow::DataType t);

// Pooling window of a MaxPool/MaxPoolGrad (attrs) or MaxPoolV2/MaxPoolGradV2 (constant inputs).
struct Window {
  std::vector<int64_t> ksize, strides;
  std::vector<int64_t> explicit_paddings;  // MaxPool / MaxPoolGrad with padding EXPLICIT
  bool operator==(const Window& o) const {
    return ksize == o.ksize && strides == o.strides && explicit_paddings == o.explicit_paddings;
  }
};

class Matcher;

// One fusion a matcher found (node indices; -1: not part of it).
struct Plan {
  const Matcher* matcher = nullptr;  // the matcher that applies it
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

class FusionPass;

// One pattern family: which nodes can root a match, the match itself (a Plan, or a refusal
// counted with FusionPass::Skip, or false without a word for a node that is no candidate after
// all), and the rewrite of a plan.
class Matcher {
 public:
  virtual ~Matcher() = default;
  // Cheap, on every node, before the consumer index exists: most graphs have no candidate.
  virtual bool IsCandidate(const FusionPass& pass, const NodeDef& n) const = 0;
  virtual bool Match(FusionPass& pass, int i, Plan* plan) const = 0;
  virtual void Apply(FusionPass& pass, const Plan& plan) const = 0;
  // Whether the pass indexes the data consumers of n (the nodes this family's matches read).
  virtual bool Indexes(const NodeDef& n) const = 0;
};

class FusionPass : public GraphPass {
 public:
  // matchers: tried in order, each over its candidates in graph order; a pool a plan takes is
  // Claimed for the later ones. mode: kArgmax or kInput. preserve: node names that must survive
  // (may be null). default_device_type: the device type assumed for nodes with no device ("" inside
  // Grappler, where devices are set; "CPU" for GraphDefs rewritten offline, see
  // tf_relupool_rewrite_graph). log: if not null, every fusion and refusal is appended to it.
  FusionPass(const std::vector<std::unique_ptr<Matcher>>& matchers, GraphDef* graph, int mode,
             const std::unordered_set<std::string>* preserve,
             const std::string& default_device_type, std::vector<std::string>* log)
      : GraphPass(graph, preserve, log),
        matchers_(matchers),
        mode_(mode),
        default_device_type_(default_device_type) {
    IndexNames();
  }

  // Counters of this run (enum Stat indices; only the fusion/refusal ones are used).
  int64_t stats[kNumStats] = {};

  // Number of fusions applied.
  int Run();

  // For the matchers: the graph and its index.
  using GraphPass::ConstInput;
  using GraphPass::ConstInts;
  using GraphPass::Find;
  using GraphPass::Log;
  using GraphPass::node;
  using GraphPass::Preserved;
  using GraphPass::UniqueName;
  int mode() const { return mode_; }
  NodeDef* mutable_node(int i) { return g_->mutable_node(i); }
  // The node feeding n's first input, or -1 (none, a control input, not in the graph).
  int Source(const NodeDef& n) const;
  const std::vector<std::pair<int, int>>& Consumers(const std::string& name, int port) const;
  // Whether an output other than 0 of the node is read.
  bool HasOtherPorts(const std::string& name) const { return has_port_gt0_.count(name) > 0; }
  bool Claimed(int pool) const { return claimed_.count(pool) > 0; }

  // Counts and explains a candidate left alone; returns false.
  bool Skip(const std::string& what, const std::string& why);
  // "" when the nodes (indices; -1 skipped) that name a device name the same one, else what
  // differs.
  std::string DeviceProblem(std::initializer_list<int> nodes) const;
  // "MaxPool 'p' after Relu 'r'" (and Pad 'x'): how refusals name a candidate.
  std::string Describe(int pool_i, int relu_i, int pad_i) const;
  // Whether a kernel exists for `n` on its device.
  bool KernelExists(const NodeDef& n) const;
  // The window of a pool or pool-gradient node, or the reason it cannot be fused.
  std::string ReadWindow(const NodeDef& n, Window* w) const;
  // Why the pool's attributes and window cannot be fused, or "".
  std::string PoolProblem(const NodeDef& pool, Window* w) const;
  // Whether n is the MaxPoolGrad(V2) of `pool` (orig_input = pool's input, orig_output = pool)
  // with the same window and attributes.
  bool IsGradOf(const NodeDef& n, const NodeDef& pool, const Window& w,
                tensorflow::DataType t) const;
  static std::string NameList(const std::vector<std::string>& names);

  // For the matchers' Apply: node `name` leaves the graph at the end; control edges on it move
  // to `replacement`. A new node is appended at the end.
  void Remove(const std::string& name, const std::string& replacement) {
    removed_[name] = replacement;
  }
  void Add(NodeDef n) { added_.push_back(std::move(n)); }

 private:
  void IndexConsumers();
  // Drops removed nodes, moves control edges on them to their replacements, appends new nodes.
  void Finish();

  const std::vector<std::unique_ptr<Matcher>>& matchers_;
  int mode_;
  std::string default_device_type_;
  std::unordered_map<std::string, std::vector<std::pair<int, int>>> consumers_;
  std::unordered_set<std::string> has_port_gt0_;
  std::unordered_set<int> claimed_;  // pool nodes taken by a plan
  std::unordered_map<std::string, std::string> removed_;  // removed node -> its replacement
};

}  // namespace grappler
}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_GRAPPLER_FUSION_H_
