// The fusion pass: stock ReLU + max pooling (and its gradient) -> tf_relupool's fused ops, on a
// GraphDef. fuse_relu_max_pool.cc lists the matchers (matchers.h), one per pattern family;
// plugin.cc runs it inside Grappler and for tf_relupool.rewrite_graph.
#ifndef TF_RELUPOOL_CC_GRAPPLER_FUSE_RELU_MAX_POOL_H_
#define TF_RELUPOOL_CC_GRAPPLER_FUSE_RELU_MAX_POOL_H_

#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "cc/grappler/graph_util.h"
#include "cc/grappler/state.h"

namespace tf_relupool {
namespace grappler {

// Fuses every pattern of the matchers in *graph; returns the number of fusions.
// mode: kArgmax or kInput. preserve: node names that must survive (may be null).
// default_device_type: the device type assumed for nodes with no device ("" inside Grappler,
// where devices are set; "CPU" for GraphDefs rewritten offline, see tf_relupool_rewrite_graph).
// log: if not null, every fusion and refusal is appended to it as one line (else the last
// refusal goes to g_last_skip). stats: kNumStats counters, the fusion/refusal ones added to.
int FuseReluMaxPool(GraphDef* graph, int mode, const std::unordered_set<std::string>* preserve,
                    const std::string& default_device_type, std::vector<std::string>* log,
                    int64_t* stats);

}  // namespace grappler
}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_GRAPPLER_FUSE_RELU_MAX_POOL_H_
