// A constant Pad between the ReLU and the pool (match_relu_then_pool.cc): whether it may move
// before the ReLU, and whether a Slice is its gradient. cc/grappler/README.md has the proof.
#ifndef TF_RELUPOOL_CC_GRAPPLER_PAD_LINK_H_
#define TF_RELUPOOL_CC_GRAPPLER_PAD_LINK_H_

#include <string>

#include "cc/grappler/fusion.h"

namespace tf_relupool {
namespace grappler {

// Why the Pad cannot move past the ReLU, or "". relu(pad(z, c)) == pad(relu(z), c) element
// by element when relu(c) == c bit for bit: Pad pads with +0, PadV2 with its constant, which
// must then be non-negative with a clear sign bit (relu(-0) may be +0). Any paddings work (the
// pool never mixes batch or channel entries, and padded entries are plain values).
std::string PadProblem(const FusionPass& pass, const NodeDef& pad);

// Whether `begin` is paddings[:, 0] of the Pad's `paddings`: either both constants with those
// values (after TF's constant folding), or _PadGrad's own subgraph on that paddings tensor,
// Reshape(Slice(paddings, [0, 0], [rank, 1]), [-1]) (graphs not constant-folded yet).
bool IsPadBefore(const FusionPass& pass, const std::string& begin, const std::string& paddings);

// Why the Pad's consumers keep it from moving, or "": the pool, the pool's gradient (set in the
// plan) and shape-only ops, nothing else.
std::string PadConsumersProblem(const FusionPass& pass, Plan* p, tensorflow::DataType t);

// Why the path from the MaxPoolGrad to the ReluGrad is not the Pad's gradient Slice alone, or ""
// (the Slice set in the plan).
std::string PadGradientProblem(const FusionPass& pass, Plan* p, tensorflow::DataType t);

}  // namespace grappler
}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_GRAPPLER_PAD_LINK_H_
