// The fusion pass: stock ReLU + max pooling, and its gradient, become tf_relupool's fused ops.
// cc/grappler/README.md has the facts this relies on. The op types of each role (pool, relu, pad,
// ...) and the list of patterns are patterns.h's table, which the trace-time fusion under XLA
// (tf_relupool/keras_fusion.py) reads too.
//
// Patterns are matched on the graph TensorFlow hands to plugin optimizers (after its own passes,
// remapper and layout optimizer included), or on a GraphDef given to tf_relupool.rewrite_graph,
// by one Matcher per pattern family (matchers.h), over the core of fusion.h:
//
//   match_relu_then_pool.cc   pool(relu(z)), pool(fused_conv_relu(z)), pool(pad(relu(z))), with
//                             or without the gradient (pad_link.h: the Pad)
//   match_pool_then_relu.cc   relu(pool(z)), forward only, the order after TF's arithmetic
//                             optimizer
//
// MaxPoolV2 / MaxPoolGradV2 (window as constant inputs) wherever MaxPool / MaxPoolGrad is.
// Nothing is rewritten unless a kernel of the fused op exists for the node's device
// (KernelDefAvailable), nor a pattern whose nodes name different devices.
//
// plugin.cc runs the same pass inside Grappler and on a serialized GraphDef for
// tf_relupool.rewrite_graph, so the explicit Python API and the switch share one implementation.

#include "cc/grappler/fuse_relu_max_pool.h"

#include <memory>
#include <vector>

#include "cc/grappler/fusion.h"
#include "cc/grappler/matchers.h"

namespace tf_relupool {
namespace grappler {
namespace {

// The families, in the order they are tried.
std::vector<std::unique_ptr<Matcher>> MakeMatchers() {
  std::vector<std::unique_ptr<Matcher>> m;
  m.push_back(ReluThenPoolMatcher());
  m.push_back(PoolThenReluMatcher());
  return m;
}

}  // namespace

int FuseReluMaxPool(GraphDef* graph, int mode, const std::unordered_set<std::string>* preserve,
                    const std::string& default_device_type, std::vector<std::string>* log,
                    int64_t* stats) {
  static const std::vector<std::unique_ptr<Matcher>> matchers = MakeMatchers();
  FusionPass pass(matchers, graph, mode, preserve, default_device_type, log);
  const int fused = pass.Run();
  for (int k = 0; k < kNumStats; ++k) stats[k] += pass.stats[k];
  return fused;
}

}  // namespace grappler
}  // namespace tf_relupool
