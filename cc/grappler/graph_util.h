// GraphDef utilities the Grappler passes share: parsing node inputs ("^ctl", "name:port"), attr
// access, device types, the nodes TensorFlow says to preserve, the dangling-input check, and
// GraphPass, the base of both passes (the graph, its node index, the log, constant inputs and
// fresh node names). No pattern lives here: the fusion pass (fusion.h) and fold_transposes.cc.
#ifndef TF_RELUPOOL_CC_GRAPPLER_GRAPH_UTIL_H_
#define TF_RELUPOOL_CC_GRAPPLER_GRAPH_UTIL_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tensorflow/c/experimental/grappler/grappler.h"
#include "tensorflow/core/framework/attr_value.pb.h"
#include "tensorflow/core/framework/graph.pb.h"
#include "tensorflow/core/framework/node_def.pb.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"

namespace tf_relupool {
namespace grappler {

using tensorflow::AttrValue;
using tensorflow::GraphDef;
using tensorflow::NodeDef;

// One input of a node: "^a" -> {a, -1}, "a" -> {a, 0}, "a:2" -> {a, 2}.
struct Input {
  std::string node;
  int index;  // -1: control input
};

Input ParseInput(const std::string& s);
bool IsControl(const std::string& s);
// The node an input names ("^a", "a", "a:2" -> "a"), without copying: for the loops over every
// input of the graph.
std::string_view InputNode(std::string_view s);
std::vector<std::string> DataInputs(const NodeDef& n);
std::vector<std::string> ControlInputs(const NodeDef& n);
const AttrValue* Attr(const NodeDef& n, const char* name);  // nullptr when absent
tensorflow::DataType TypeAttr(const NodeDef& n, const char* name);  // DT_INVALID when absent
std::string StringAttr(const NodeDef& n, const char* name, const std::string& dflt);
// "/job:localhost/replica:0/task:0/device:GPU:0" -> "GPU"; "" when unknown.
std::string DeviceType(const std::string& device);
// Nodes TensorFlow says must survive (fetch, feed, keep ops) into *out; false when TensorFlow's
// functions for it cannot be found (graph_util.cc says why they are looked up at run time).
bool NodesToPreserve(const TF_GrapplerItem* item, std::unordered_set<std::string>* out);
// Every input of every node names a node of the graph ("" when so, else the first problem).
std::string DanglingInput(const GraphDef& graph);

// What both passes need: the graph, its node index, the nodes to preserve, the log,
// constant inputs, and names for new nodes.
class GraphPass {
 protected:
  GraphPass(GraphDef* graph, const std::unordered_set<std::string>* preserve,
            std::vector<std::string>* log)
      : g_(graph), preserve_(preserve), log_(log) {}

  void IndexNames() {
    index_.reserve(g_->node_size());
    for (int i = 0; i < g_->node_size(); ++i) index_[g_->node(i).name()] = i;
  }
  const NodeDef& node(int i) const { return g_->node(i); }
  int Find(const std::string& name) const {
    auto it = index_.find(name);
    return it == index_.end() ? -1 : it->second;
  }
  bool Preserved(const std::string& name) const {
    return preserve_ != nullptr && preserve_->count(name);
  }
  bool Preserved(int i) const { return Preserved(node(i).name()); }

  // Appends text to the log (when there is one) and LOG(INFO)s it when verbose.
  void Log(const std::string& text);
  // The tensor of a Const node feeding `input` (false if it is none).
  bool ConstInput(const std::string& input, tensorflow::Tensor* out) const;
  // The integers of a 1-D int32/int64 Const feeding `input`.
  bool ConstInts(const std::string& input, std::vector<int64_t>* out) const;
  // `base`, or `base_N`, unused by the graph and by earlier calls.
  std::string UniqueName(const std::string& base);

  GraphDef* g_;
  const std::unordered_set<std::string>* preserve_;
  std::vector<std::string>* log_;
  std::unordered_map<std::string, int> index_;
  std::unordered_set<std::string> added_names_;
  std::vector<NodeDef> added_;  // new nodes, appended to the graph at the end
};

}  // namespace grappler
}  // namespace tf_relupool

#endif  // TF_RELUPOOL_CC_GRAPPLER_GRAPH_UTIL_H_
