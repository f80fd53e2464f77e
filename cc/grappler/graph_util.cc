// Definitions of graph_util.h.
#include "cc/grappler/graph_util.h"

#include <dlfcn.h>

#include <cctype>
#include <cstdlib>

#include "cc/grappler/state.h"  // g_verbose
#include "tensorflow/core/platform/logging.h"

namespace tf_relupool {
namespace grappler {

Input ParseInput(const std::string& s) {
  if (!s.empty() && s[0] == '^') return {s.substr(1), -1};
  const size_t colon = s.rfind(':');
  if (colon != std::string::npos && colon + 1 < s.size()) {
    bool digits = true;
    for (size_t i = colon + 1; i < s.size(); ++i) digits = digits && isdigit(s[i]);
    if (digits) return {s.substr(0, colon), atoi(s.c_str() + colon + 1)};
  }
  return {s, 0};
}

bool IsControl(const std::string& s) { return !s.empty() && s[0] == '^'; }

std::string_view InputNode(std::string_view s) {
  if (!s.empty() && s[0] == '^') return s.substr(1);
  const size_t colon = s.rfind(':');
  if (colon == std::string_view::npos || colon + 1 == s.size()) return s;
  for (size_t i = colon + 1; i < s.size(); ++i)
    if (!isdigit(static_cast<unsigned char>(s[i]))) return s;
  return s.substr(0, colon);
}

std::vector<std::string> DataInputs(const NodeDef& n) {
  std::vector<std::string> v;
  for (const auto& i : n.input())
    if (!IsControl(i)) v.push_back(i);
  return v;
}

std::vector<std::string> ControlInputs(const NodeDef& n) {
  std::vector<std::string> v;
  for (const auto& i : n.input())
    if (IsControl(i)) v.push_back(i);
  return v;
}

const AttrValue* Attr(const NodeDef& n, const char* name) {
  auto it = n.attr().find(name);
  return it == n.attr().end() ? nullptr : &it->second;
}

tensorflow::DataType TypeAttr(const NodeDef& n, const char* name) {
  const AttrValue* a = Attr(n, name);
  return a == nullptr ? tensorflow::DT_INVALID : a->type();
}

std::string StringAttr(const NodeDef& n, const char* name, const std::string& dflt) {
  const AttrValue* a = Attr(n, name);
  return a == nullptr ? dflt : a->s();
}

std::string DeviceType(const std::string& device) {
  const size_t at = device.rfind("device:");
  if (at == std::string::npos) return "";
  const size_t start = at + 7;
  const size_t colon = device.find(':', start);
  return device.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
}

// Nodes TensorFlow says must survive (fetch, feed, keep ops). The functions live in
// libtensorflow_cc.so.2, which every TensorFlow Python process has loaded; they are looked up at
// run time so that this file links against libtensorflow_framework.so.2 alone (like the op
// library it is part of). Returns false when they cannot be found.
namespace {

using PreserveSizeFn = void (*)(const TF_GrapplerItem*, int*, size_t*, TF_Status*);
using PreserveListFn = void (*)(const TF_GrapplerItem*, char**, size_t*, int, void*, size_t,
                                TF_Status*);

void* FindTfSymbol(const char* name) {
  void* sym = dlsym(RTLD_DEFAULT, name);
  if (sym != nullptr) return sym;
  static void* cc = dlopen("libtensorflow_cc.so.2", RTLD_LAZY | RTLD_NOLOAD);
  return cc == nullptr ? nullptr : dlsym(cc, name);
}

}  // namespace

bool NodesToPreserve(const TF_GrapplerItem* item, std::unordered_set<std::string>* out) {
  static PreserveSizeFn size_fn =
      reinterpret_cast<PreserveSizeFn>(FindTfSymbol("TF_GetNodesToPreserveListSize"));
  static PreserveListFn list_fn =
      reinterpret_cast<PreserveListFn>(FindTfSymbol("TF_GetNodesToPreserveList"));
  if (size_fn == nullptr || list_fn == nullptr || item == nullptr) return false;
  TF_Status* status = TF_NewStatus();
  int num = 0;
  size_t storage_size = 0;
  size_fn(item, &num, &storage_size, status);
  bool ok = TF_GetCode(status) == TF_OK;
  if (ok && num > 0) {
    std::vector<char*> values(num);
    std::vector<size_t> lengths(num);
    std::vector<char> storage(storage_size + 1);
    list_fn(item, values.data(), lengths.data(), num, storage.data(), storage.size(), status);
    ok = TF_GetCode(status) == TF_OK;
    for (int i = 0; ok && i < num; ++i) out->emplace(values[i], lengths[i]);
  }
  TF_DeleteStatus(status);
  return ok;
}

std::string DanglingInput(const GraphDef& graph) {
  std::unordered_set<std::string_view> names;
  names.reserve(graph.node_size());
  for (const auto& n : graph.node()) names.insert(n.name());
  for (const auto& n : graph.node())
    for (const auto& in : n.input())
      if (!names.count(InputNode(in))) return "'" + n.name() + "' input '" + in + "'";
  return "";
}

void GraphPass::Log(const std::string& text) {
  if (log_ != nullptr) log_->push_back(text);
  if (g_verbose.load()) LOG(INFO) << "tf_relupool grappler: " << text;
}

bool GraphPass::ConstInput(const std::string& input, tensorflow::Tensor* out) const {
  if (IsControl(input)) return false;
  const Input in = ParseInput(input);
  const int i = Find(in.node);
  if (i < 0 || in.index != 0 || node(i).op() != "Const") return false;
  const AttrValue* v = Attr(node(i), "value");
  return v != nullptr && out->FromProto(v->tensor());
}

bool GraphPass::ConstInts(const std::string& input, std::vector<int64_t>* out) const {
  tensorflow::Tensor t;
  if (!ConstInput(input, &t) || t.dims() != 1) return false;
  out->clear();
  if (t.dtype() == tensorflow::DT_INT32) {
    for (int64_t i = 0; i < t.NumElements(); ++i) out->push_back(t.flat<int32_t>()(i));
  } else if (t.dtype() == tensorflow::DT_INT64) {
    for (int64_t i = 0; i < t.NumElements(); ++i) out->push_back(t.flat<int64_t>()(i));
  } else {
    return false;
  }
  return true;
}

std::string GraphPass::UniqueName(const std::string& base) {
  std::string name = base;
  for (int i = 1; index_.count(name) || added_names_.count(name); ++i)
    name = base + "_" + std::to_string(i);
  added_names_.insert(name);
  return name;
}

}  // namespace grappler
}  // namespace tf_relupool
