// The layout pass: tf_relupool's fused ops in their own NCHW form between the layout optimizer's
// Transposes, instead of NHWC ops wrapped in transposed copies (fold_transposes.cc says how).
#ifndef TF_RELUPOOL_CC_GRAPPLER_FOLD_TRANSPOSES_H_
#define TF_RELUPOOL_CC_GRAPPLER_FOLD_TRANSPOSES_H_

#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "cc/grappler/graph_util.h"

namespace tf_relupool {
namespace grappler {

// Switches the fused ops that read a layout-optimizer Transpose to NCHW in *graph; returns how
// many. preserve: node names that must survive (may be null); log: one line per change (may be
// null); *removed_transposes: Transposes removed, added to.
int FoldTransposes(GraphDef* graph, const std::unordered_set<std::string>* preserve,
                   std::vector<std::string>* log, int64_t* removed_transposes);

}  // namespace grappler
}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_GRAPPLER_FOLD_TRANSPOSES_H_
