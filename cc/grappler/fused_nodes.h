// The fused nodes of a Plan (fusion.h): the fused forward and gradient, with the pool's attributes
// and window. Built by the matchers to check that kernels exist and to rewrite the graph.
#ifndef TF_RELUPOOL_CC_GRAPPLER_FUSED_NODES_H_
#define TF_RELUPOOL_CC_GRAPPLER_FUSED_NODES_H_

#include <string>

#include "cc/grappler/fusion.h"

namespace tf_relupool {
namespace grappler {

// Whether the plan's fused ops keep window argmax codes (keep "argmax" with a gradient).
bool WithArgmax(const FusionPass& pass, const Plan& p);

// The fused op's input: the pre-ReLU tensor, padded when there is a Pad.
std::string PoolInput(const FusionPass& pass, const Plan& p);

// The fused forward: named and placed as the pool (as the Relu for Relu(MaxPool(z))).
void BuildForward(const FusionPass& pass, const Plan& p, NodeDef* fwd);

// The fused gradient. Without a Pad it replaces the ReluGrad (and takes its name); with a Pad it
// replaces the MaxPoolGrad (its name), and the Pad's gradient Slice moves to the ReluGrad's.
// shape_name: the Shape node of the fused op's input (argmax codes only).
void BuildBackward(const FusionPass& pass, const Plan& p, const NodeDef& fwd,
                   const std::string& shape_name, NodeDef* bwd);

// Why the plan's fused nodes cannot run ("no <op> kernel for device ..."), or "": nothing is
// rewritten unless a kernel of each fused op exists for its node's device.
std::string KernelProblem(const FusionPass& pass, const Plan& p);

}  // namespace grappler
}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_GRAPPLER_FUSED_NODES_H_
