// The pattern families of the fusion pass, one Matcher each (fusion.h), in the order
// fuse_relu_max_pool.cc tries them. The patterns each one matches are patterns.h's table.
#ifndef TF_RELUPOOL_CC_GRAPPLER_MATCHERS_H_
#define TF_RELUPOOL_CC_GRAPPLER_MATCHERS_H_

#include <memory>

#include "cc/grappler/fusion.h"

namespace tf_relupool {
namespace grappler {

// pool(relu(z)), pool(fused_conv_relu(z)), pool(pad(relu(z))), with or without the gradient
// (match_relu_then_pool.cc).
std::unique_ptr<Matcher> ReluThenPoolMatcher();

// relu(pool(z)), forward only (match_pool_then_relu.cc).
std::unique_ptr<Matcher> PoolThenReluMatcher();

}  // namespace grappler
}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_GRAPPLER_MATCHERS_H_
